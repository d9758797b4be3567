"""A GGUF file as plain data, to take apart and write back byte for byte: the hostile-input
tests start from a valid tiny file (`llamakit.write_tiny_gguf`) and change one thing.

`gguf.GGUFWriter` writes only what is valid (UTF-8 keys, tensors where it puts them); this
writes anything: a string of invalid UTF-8, a value of the wrong type, a tensor whose offset
points past the data or into another tensor's bytes. The layout is GGUF v3's: a header,
metadata (key, type, value), tensor entries (name, dims, type, offset), padding to the
alignment, then the data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

# Metadata value types and their struct formats; 8 is a string, 9 an array.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
           U64: "Q", I64: "q", F64: "d"}
ALIGNMENT = 32


@dataclass(frozen=True)
class Value:
    """One metadata value: its type, and for an array the type of its items. Strings are
    bytes (so they need not be UTF-8); an array's value is a list."""

    kind: int
    value: object
    item: int | None = None


@dataclass(frozen=True)
class Tensor:
    name: bytes
    dims: tuple[int, ...]  # GGML's order: the innermost first
    kind: int  # the GGML type (0 F32, 8 Q8_0, ...)
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUF:
    metadata: dict[str, Value]
    tensors: list[Tensor]
    data: bytes
    version: int = 3
    # What the header claims, when a test wants it to lie (None: the true counts).
    n_tensors: int | None = None
    n_keys: int | None = None

    def with_value(self, key: str, value: Value | None) -> GGUF:
        """This file with one metadata entry set (None: removed), in its place."""
        metadata = dict(self.metadata)
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
        return replace(self, metadata=metadata)

    def with_tensor(self, i: int, **changes) -> GGUF:
        tensors = list(self.tensors)
        tensors[i] = replace(tensors[i], **changes)
        return replace(self, tensors=tensors)


def _string(data: bytes, at: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    return bytes(data[at + 8: at + 8 + n]), at + 8 + n


def _value(data: bytes, at: int, kind: int) -> tuple[object, int]:
    if kind == STRING:
        return _string(data, at)
    fmt = "<" + FORMATS[kind]
    return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)


def parse(data: bytes) -> GGUF:
    """A valid GGUF file's bytes as a `GGUF` (no checks: the input is the tests' own)."""
    version, n_tensors, n_keys = struct.unpack_from("<IQQ", data, 4)
    at, metadata = 24, {}
    for _ in range(n_keys):
        key, at = _string(data, at)
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if kind == ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            items = []
            for _ in range(count):
                v, at = _value(data, at, item)
                items.append(v)
            metadata[key.decode()] = Value(ARRAY, items, item)
        else:
            v, at = _value(data, at, kind)
            metadata[key.decode()] = Value(kind, v)
    tensors = []
    for _ in range(n_tensors):
        name, at = _string(data, at)
        (n_dims,) = struct.unpack_from("<I", data, at)
        dims = struct.unpack_from(f"<{n_dims}Q", data, at + 4)
        kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        tensors.append(Tensor(name, tuple(dims), kind, offset))
    align = metadata.get("general.alignment", Value(U32, ALIGNMENT)).value
    start = -(-at // align) * align
    return GGUF(metadata, tensors, bytes(data[start:]), version)


def _pack_value(kind: int, value) -> bytes:
    if kind == STRING:
        raw = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<Q", len(raw)) + raw
    return struct.pack("<" + FORMATS[kind], value)


def _pack_entry(key: str, v: Value) -> bytes:
    out = _pack_value(STRING, key.encode()) + struct.pack("<I", v.kind)
    if v.kind == ARRAY:
        out += struct.pack("<IQ", v.item, len(v.value))
        if v.item == STRING:  # joined at once: the tests write arrays of a million
            out += b"".join(_pack_value(STRING, s) for s in v.value)
        else:
            out += struct.pack(f"<{len(v.value)}{FORMATS[v.item]}", *v.value)
        return out
    return out + _pack_value(v.kind, v.value)


def write(g: GGUF) -> bytes:
    """The file's bytes; the data section starts at the next multiple of the alignment."""
    head = b"GGUF" + struct.pack("<IQQ", g.version,
                                 len(g.tensors) if g.n_tensors is None else g.n_tensors,
                                 len(g.metadata) if g.n_keys is None else g.n_keys)
    body = b"".join(_pack_entry(k, v) for k, v in g.metadata.items())
    for t in g.tensors:
        body += (_pack_value(STRING, t.name) + struct.pack("<I", len(t.dims))
                 + struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.kind, t.offset))
    align = g.metadata.get("general.alignment", Value(U32, ALIGNMENT)).value
    if not isinstance(align, int) or align <= 0:
        align = ALIGNMENT
    size = len(head) + len(body)
    return head + body + bytes(-size % align) + g.data


def tensor_bytes(g: GGUF, i: int) -> tuple[int, int]:
    """(start, end) of tensor i's bytes in the data section, for F32 and F16 tensors."""
    t = g.tensors[i]
    n = 1
    for d in t.dims:
        n *= d
    return t.offset, t.offset + n * {0: 4, 1: 2}[t.kind]
