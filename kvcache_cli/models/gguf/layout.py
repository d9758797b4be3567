"""A GGUF file's layout, read and checked: the header, every metadata value, every tensor's
entry and where its bytes lie. Torch-free (numpy for numeric arrays).

The format (llama.cpp's `gguf.md`): a header (magic, version, tensor and metadata counts),
metadata entries (a key, a type, a value: a number, a string, or an array of either), tensor
entries (a name, up to 4 dimensions, a GGML type, an offset), padding to the alignment, then
the tensors' data. Every count and length is checked against the file's size before it is
used, so a file claiming 2^60 strings or a string past the end is refused before anything
is allocated for it; every string must be UTF-8, every key and tensor name unique, every
tensor's bytes inside the data section, aligned, apart from every other tensor's, and
exactly what its shape and type take (whole blocks a row; no unaccounted bytes before the
next tensor, as llama.cpp requires). What
the values mean to a model is `reader`'s business.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# Metadata value types (GGUF v2/v3): their struct formats; 8 is a string, 9 an array.
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
MAX_KEYS = 100_000  # a model has ~40 metadata entries, and tensors a few per layer
MAX_TENSORS = 1_000_000
MAX_DIMS = 4  # GGML tensors have at most 4 dimensions
MAX_KEY_BYTES = 1024  # llama.cpp's keys are dotted names of a few dozen bytes
MAX_NAME_BYTES = 64  # GGML_MAX_NAME, llama.cpp's limit on a tensor's name
MAX_STRING_BYTES = 2**20  # any one value: a chat template is a few KiB
MAX_ARRAY = 2**20  # entries of one array: Llama 3 has 280,147 merges
MAX_STRINGS = 2**21  # strings in all arrays together: each is a Python object, parsed one by one
MAX_ALIGNMENT = 2**16


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # numpy's order: (out, in); GGML lists the innermost first
    kind: str  # the GGML type's name: F32, Q4_1, ...
    start: int  # its bytes in the file: [start, end)
    end: int
    block: int  # weights per block of its type (1 for F32), and the bytes of one block
    block_bytes: int


@dataclass(frozen=True)
class Layout:
    metadata: dict[str, object]  # key → int, float, bool, str, or a list of one of those
    tensors: list[TensorEntry]
    data_start: int
    alignment: int


def check_file(path: Path) -> int:
    """The size of the file at `path`, if it is a regular file a GGUF header fits in and
    this machine's memory holds (its weights are read into memory as float32, at least as
    large); else a ValueError. A FIFO, a device or a directory is never opened."""
    from kvcache_cli.models.bounds import gib, physical_memory

    def fail(what: str):
        raise ValueError(f"{path}: {what}; expected a GGUF model file")

    try:
        info = os.stat(path)
    except FileNotFoundError:
        fail("no such file")
    except (OSError, ValueError) as err:  # a symlink loop, a name too long, a NUL byte
        fail(f"cannot be read ({getattr(err, 'strerror', None) or err})")
    if not stat.S_ISREG(info.st_mode):
        fail("not a regular file")
    if info.st_size < 24:
        fail(f"{info.st_size} bytes, too short for a GGUF header")
    memory = physical_memory()
    if memory is not None and info.st_size > memory:
        fail(f"{info.st_size:,} bytes, more than this machine's {gib(memory)} of memory, "
             "which must hold its weights in float32")
    return info.st_size


def open_file(path: Path):
    """(a read-only memory map of the file, its size), the file checked as `check_file`
    does; opened without blocking, so a FIFO put in its place since is not waited on."""
    import mmap

    check_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror}); expected a GGUF model "
                         "file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < 24:
            raise ValueError(f"{path}: changed while it was opened; expected a GGUF model file")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), info.st_size
    finally:
        os.close(fd)  # the map keeps its own reference to the file


class _Walk:
    """A cursor over the file's bytes that refuses to step past the end."""

    def __init__(self, path: Path, data, size: int):
        self.path, self.data, self.size, self.at = path, data, size, 0

    def fail(self, what: str):
        raise ValueError(f"{self.path}: {what}; expected a GGUF model file")

    def need(self, n: int) -> None:
        if self.at + n > self.size:
            self.fail(f"truncated: an entry at byte {self.at:,} runs past the end "
                      f"({self.size:,} bytes)")

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += n
        return values if len(values) > 1 else values[0]

    def string(self, what: str, limit: int) -> str:
        n = self.unpack("<Q")
        self.need(n)
        if n > limit:
            self.fail(f"{what} is a string of {n:,} bytes (at most {limit:,})")
        raw = bytes(self.data[self.at: self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self.fail(f"{what} is not UTF-8 text (byte {err.start:,} of {n:,})")


def read_layout(path: Path, data, size: int) -> Layout:
    """The layout of the GGUF whose bytes are `data` (a memory map of `size` bytes)."""
    w = _Walk(path, data, size)
    n_tensors, n_keys = _header(w)
    metadata = _metadata(w, n_keys)
    alignment = metadata.get("general.alignment", 32)
    if (isinstance(alignment, bool) or not isinstance(alignment, int)
            or not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1)):
        w.fail(f"general.alignment is {alignment!r:.40}; expected a power of two from 1 to "
               f"{MAX_ALIGNMENT:,}")
    entries = [_tensor_entry(w) for _ in range(n_tensors)]
    data_start = -(-w.at // alignment) * alignment
    return Layout(metadata, _placed(w, entries, data_start, alignment), data_start, alignment)


def _header(w: _Walk) -> tuple[int, int]:
    """(tensors, metadata entries) the header counts, checked against the file's size; the
    cursor past the header."""
    if w.size < 24 or bytes(w.data[:4]) != MAGIC:
        w.fail("not a GGUF file (no 'GGUF' magic at its start)")
    w.at = 4
    version, n_tensors, n_keys = w.unpack("<IQQ")
    if version not in (2, 3):
        w.fail(f"GGUF version {version}, which kvcache does not read (2 or 3)")
    # A tensor's entry takes at least 33 bytes, a metadata entry at least 13: counts the
    # file cannot hold are refused before anything is allocated for them.
    if n_tensors > MAX_TENSORS or n_keys > MAX_KEYS or 33 * n_tensors + 13 * n_keys > w.size:
        w.fail(f"the header claims {n_tensors:,} tensors and {n_keys:,} metadata entries, "
               f"more than its {w.size:,} bytes can hold")
    return n_tensors, n_keys


def architecture(path: Path) -> str | None:
    """A GGUF's `general.architecture` (llama.cpp writes it first), read without the rest
    of its metadata (the vocabulary takes most of a second); None when it has none, a
    ValueError for a file that is no GGUF."""
    data, size = open_file(path)
    w = _Walk(path, data, size)
    for key, value in _entries(w, _header(w)[1]):
        if key == "general.architecture":
            return value if isinstance(value, str) else None
    return None


def _metadata(w: _Walk, n_keys: int) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for key, value in _entries(w, n_keys):
        if key in metadata:
            w.fail(f"metadata key {key!r} is given twice")
        metadata[key] = value
    return metadata


def _entries(w: _Walk, n_keys: int):
    """Each metadata entry as (key, value), read one by one."""
    strings = 0
    for _ in range(n_keys):
        key = w.string("a metadata key", MAX_KEY_BYTES)
        kind = w.unpack("<I")
        if kind == _ARRAY:
            item, count = w.unpack("<IQ")
            if item != _STRING and item not in _FORMATS:
                w.fail(f"metadata {key} is an array of unknown type {item}")
            # A string takes at least its 8-byte length: a count the rest cannot hold
            # is refused before anything is allocated for it.
            each = 8 if item == _STRING else struct.calcsize(_FORMATS[item])
            w.need(count * each)
            if count > MAX_ARRAY:
                w.fail(f"metadata {key} is an array of {count:,} entries (at most "
                       f"{MAX_ARRAY:,})")
            if item == _STRING:
                strings += count
                if strings > MAX_STRINGS:
                    w.fail(f"metadata arrays hold more than {MAX_STRINGS:,} strings in all")
                value = [w.string(f"metadata {key}[{i}]", MAX_STRING_BYTES)
                         for i in range(count)]
            else:
                import numpy as np

                dtype = np.dtype("<" + _FORMATS[item])
                value = np.frombuffer(w.data, dtype, count, w.at).tolist()
                w.at += count * dtype.itemsize
        elif kind == _STRING:
            value = w.string(f"metadata {key}", MAX_STRING_BYTES)
        elif kind in _FORMATS:
            value = w.unpack("<" + _FORMATS[kind])
        else:
            w.fail(f"metadata {key} has a value of unknown type {kind}")
        yield key, value


def _tensor_entry(w: _Walk) -> tuple[str, tuple[int, ...], int, int]:
    name = w.string("a tensor's name", MAX_NAME_BYTES)
    n_dims = w.unpack("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        w.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = w.unpack(f"<{n_dims}Q")
    dims = dims if isinstance(dims, tuple) else (dims,)
    kind, offset = w.unpack("<IQ")
    return name, tuple(reversed(dims)), kind, offset


def _placed(w: _Walk, entries, data_start: int, alignment: int) -> list[TensorEntry]:
    """Each entry's bytes, checked: a known type, whole blocks, aligned, inside the file,
    overlapping no other tensor; and nothing but padding after the last."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors, seen = [], set()
    for name, shape, kind, offset in entries:
        if name in seen:
            w.fail(f"tensor {name!r} is given twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(kind)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            w.fail(f"tensor {name!r} is of unknown GGML type {kind}")
        if 0 in shape:
            w.fail(f"tensor {name!r} has shape {shape}; expected no dimension of 0")
        n = 1
        for d in shape:
            n *= d  # Python's integers: a product cannot overflow, only run past the end
        if shape[-1] % block:
            w.fail(f"tensor {name!r} has rows of {shape[-1]:,} weights; its type "
                   f"{qtype.name} stores blocks of {block}: expected rows of whole blocks")
        if offset % alignment:
            w.fail(f"tensor {name!r} starts at offset {offset:,}, not a multiple of the "
                   f"alignment {alignment}")
        start = data_start + offset
        end = start + n // block * block_bytes
        if end > w.size:
            w.fail(f"tensor {name!r} runs from byte {start:,} to {end:,}, past the end of the "
                   f"file ({w.size:,} bytes; truncated?)")
        tensors.append(TensorEntry(name, shape, qtype.name, start, end, block, block_bytes))
    last, previous = data_start, None
    for t in sorted(tensors, key=lambda t: t.start):
        if t.start < last:
            w.fail(f"tensor {t.name!r} starts at byte {t.start:,}, inside tensor "
                   f"{previous.name!r}'s bytes (which its shape and type end at {last:,}); "
                   "expected tensors apart")
        # A tensor's bytes are its shape's blocks, padded to the alignment, and the next
        # begins there (llama.cpp refuses any other offset): a larger gap is bytes that no
        # shape and type account for.
        if t.start > -(-last // alignment) * alignment:
            if previous is None:
                w.fail(f"tensor {t.name!r} starts at offset {t.start - data_start:,}; expected "
                       "the first tensor at offset 0, where the data section starts")
            w.fail(f"tensor {previous.name!r} holds {t.start - previous.start:,} bytes up to "
                   f"the next tensor's, while its shape {previous.shape} in {previous.kind} "
                   f"takes {previous.end - previous.start:,}; expected the bytes its shape "
                   f"and type take, padded to the alignment {alignment}")
        last, previous = t.end, t
    # The writer pads the last tensor to the alignment; anything more is not the model's.
    if w.size - last > alignment:
        whose = f", where the shape and type of {previous.name!r} end it" if previous else ""
        w.fail(f"{w.size - last:,} bytes after the last tensor's end (byte {last:,}{whose}); "
               "expected the file to end there")
    return tensors
