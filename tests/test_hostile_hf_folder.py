"""Hostile transformers model folders, generated from the formats (issue 43): each case copies a
tiny real folder of one of several architectures and changes one thing in it, drawn from the
files themselves: every config.json key (dropped, or set to a value of every JSON kind and a
few bad numbers), every safetensors tensor (dropped, reshaped, recast, renamed, NaN) and the file's
bytes (cut short, a header that lies), every tokenizer.json key and the file's bytes, the
weights' format (pickles only, shards that are missing or outside the folder), and every
metadata key of a GGUF file transformers reads (dropped, or a value of another type or size).

Every case must end in a loaded model or in one HFLoadError line, with nothing on stderr,
within a deadline (never a hang, never another exception), and no pickle may ever be opened:
each folder holds a `pytorch_model.bin` whose unpickling would create a marker file. Cases are
sampled with a fixed seed to keep the run short; each test records its count per outcome
(`record_property`, in pytest's junit XML).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import signal
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ggufkit import ARRAY, BOOL, F32, I32, STRING, U32, U64, Value, parse, write
from hfkit import ARCHITECTURES, save_folder

from kvcache_cli.hf.load import HFLoadError, load_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 43
DEADLINE_S = 30  # a tiny model loads in a fraction of a second; a hang never returns
# JSON values of every kind, and the numbers a size or a rate must not be.
VALUES = {"null": None, "zero": 0, "negative": -1, "huge": 2**40, "half": 0.5,
          "nan": float("nan"), "true": True, "text": "no_such_kind",
          "list": ["NoSuchForCausalLM"], "object": {}}
Mutation = Callable[[Path], None]


class Hang(Exception):
    pass


class Planted:
    """Unpickling this creates the file it names."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {arch: save_folder(root / arch, arch, seed=7) for arch in ARCHITECTURES}


def outcome(folder: Path) -> str:
    """'loaded', 'refused' (one HFLoadError line), or what went wrong instead."""

    def expire(signum, frame):
        raise Hang

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(DEADLINE_S)
    try:
        load_hf(str(folder))
    except HFLoadError as err:
        text = str(err)
        return "refused" if text and "\n" not in text else f"not one line: {text!r}"
    except Hang:
        return f"hang (over {DEADLINE_S} s)"
    except Exception as err:  # noqa: BLE001 - any other exception is the finding
        return f"{type(err).__name__}: {str(err)[:200]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return "loaded"


def run_cases(cases: list[tuple[str, str, Mutation]], bases, tmp_path, capfd,
              record_property) -> Counter:
    """Each (architecture, label, mutation) on its own copy, pickle planted; the outcomes."""
    counts, wrong = Counter(), []
    marker = tmp_path / "unpickled"
    for i, (arch, label, mutate) in enumerate(cases):
        folder = tmp_path / f"case{i}"
        shutil.copytree(bases[arch], folder)
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(marker)))
        mutate(folder)
        result = outcome(next(folder.glob("*.gguf"), folder))  # a GGUF case loads its file
        err = capfd.readouterr().err
        if err:
            result = f"wrote to stderr: {err[:200]!r}"
        counts[result if result in ("loaded", "refused") else "wrong"] += 1
        if result not in ("loaded", "refused"):
            wrong.append(f"{arch} {label}: {result}")
        shutil.rmtree(folder)
    record_property("outcomes", dict(counts))
    assert not marker.exists(), "a pickle was unpickled"
    assert not wrong, "\n".join(wrong)
    return counts


def sample(cases: list, n: int) -> list:
    return random.Random(SEED).sample(cases, min(n, len(cases)))


# --- config.json --------------------------------------------------------------------------


def edit_json(name: str, change: Callable[[object], object]) -> Mutation:
    def mutate(folder: Path) -> None:
        path = folder / name
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return mutate


def set_at(keys: tuple[str, ...], value, drop: bool = False) -> Callable[[dict], dict]:
    """A change setting (or dropping) the value at the path KEYS of nested objects."""
    def change(doc: dict) -> dict:
        inner = doc
        for key in keys[:-1]:
            inner = inner[key]
        if drop:
            del inner[keys[-1]]
        else:
            inner[keys[-1]] = value
        return doc
    return change


def paths(doc: dict, above: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key's path in DOC, nested objects' keys included."""
    for key, value in doc.items():
        yield (*above, key)
        if isinstance(value, dict):
            yield from paths(value, (*above, key))


def cut(name: str, fraction: float) -> Mutation:
    def mutate(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * fraction)])
    return mutate


CUTS = (0.0, 0.01, 0.3, 0.5, 0.9, 0.999)


def config_cases(bases) -> list[tuple[str, str, Mutation]]:
    cases = []
    for arch, base in bases.items():
        config = json.loads((base / "config.json").read_text())
        for keys in paths(config):
            where = ".".join(keys)
            cases.append((arch, f"drop {where}", edit_json("config.json", set_at(keys, None,
                                                                                 drop=True))))
            for name, value in VALUES.items():
                cases.append((arch, f"{where}={name}",
                              edit_json("config.json", set_at(keys, value))))
        auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
        cases.append((arch, "auto_map", edit_json("config.json", set_at(("auto_map",),
                                                                          auto_map))))
        for fraction in CUTS:
            cases.append((arch, f"config cut at {fraction}", cut("config.json", fraction)))
        for name, value in VALUES.items():
            cases.append((arch, f"config is {name}",
                          edit_json("config.json", lambda _, v=value: v)))
    return cases


def test_hostile_configs_end_in_a_model_or_one_line(bases, tmp_path, capfd, record_property):
    counts = run_cases(sample(config_cases(bases), 160), bases, tmp_path, capfd,
                       record_property)
    assert counts["refused"] > 0 and counts["loaded"] > 0  # both ends are reached


# --- model.safetensors --------------------------------------------------------------------


def edit_tensors(change: Callable[[dict], None]) -> Mutation:
    """Rewrite model.safetensors, a valid file of the changed tensors (numpy arrays)."""
    from safetensors.numpy import load_file, save_file

    def mutate(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return mutate


def header_of(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def edit_header(change: Callable[[dict], None]) -> Mutation:
    """Rewrite the header's JSON alone, the tensors' bytes left where they were."""
    def mutate(folder: Path) -> None:
        path = folder / "model.safetensors"
        header, body = header_of(path.read_bytes())
        change(header)
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return mutate


def tensor_changes(name: str, shape: tuple[int, ...]) -> dict[str, Callable[[dict], None]]:
    """What can be done to one tensor, as a valid file still holding it."""
    import numpy as np

    def grow(t):
        t[name] = np.concatenate([t[name], t[name][:1]])  # one more row
    changes = {
        "drop": lambda t: t.pop(name),
        "grow": grow,
        "flatten": lambda t: t.__setitem__(name, t[name].reshape(-1)),
        "float16": lambda t: t.__setitem__(name, t[name].astype(np.float16)),
        "int8": lambda t: t.__setitem__(name, t[name].astype(np.int8)),
        "bool": lambda t: t.__setitem__(name, t[name] > 0),
        "rename": lambda t: t.__setitem__("x." + name, t.pop(name)),
        "nan": lambda t: t.__setitem__(name, t[name] * np.float32("nan")),
        "duplicate": lambda t: t.__setitem__("extra." + name, t[name].copy()),
    }
    if len(shape) == 2 and shape[0] != shape[1]:
        changes["transpose"] = lambda t: t.__setitem__(name, np.ascontiguousarray(t[name].T))
    return changes


def header_changes(name: str, entry: dict) -> dict[str, Callable[[dict], None]]:
    """Lies one tensor's header entry can tell about the bytes that follow."""
    begin, end = entry["data_offsets"]
    return {
        "dtype Q7": lambda h: h[name].__setitem__("dtype", "Q7"),
        "dtype F64": lambda h: h[name].__setitem__("dtype", "F64"),
        "shape +1": lambda h: h[name].__setitem__("shape", [d + 1 for d in entry["shape"]]),
        "shape -1": lambda h: h[name].__setitem__("shape", [-1, *entry["shape"][1:]]),
        "offsets past the end": lambda h: h[name].__setitem__("data_offsets",
                                                              [begin, end + 10**9]),
        "offsets reversed": lambda h: h[name].__setitem__("data_offsets", [end, begin]),
        "entry a list": lambda h: h.__setitem__(name, [1, 2]),
    }


def safetensors_cases(bases) -> list[tuple[str, str, Mutation]]:
    cases = []
    for arch, base in bases.items():
        data = (base / "model.safetensors").read_bytes()
        header, _ = header_of(data)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            for what, change in tensor_changes(name, tuple(entry["shape"])).items():
                cases.append((arch, f"{name} {what}", edit_tensors(change)))
            for what, change in header_changes(name, entry).items():
                cases.append((arch, f"{name} header {what}", edit_header(change)))
        for fraction in CUTS:
            cases.append((arch, f"safetensors cut at {fraction}",
                          cut("model.safetensors", fraction)))
        for length in (0, 2, len(data), 2**63):
            cases.append((arch, f"header length {length}", length_field(length)))
    return cases


def length_field(length: int) -> Mutation:
    def mutate(folder: Path) -> None:
        path = folder / "model.safetensors"
        path.write_bytes(struct.pack("<Q", length) + path.read_bytes()[8:])
    return mutate


def test_hostile_safetensors_end_in_a_model_or_one_line(bases, tmp_path, capfd,
                                                       record_property):
    counts = run_cases(sample(safetensors_cases(bases), 150), bases, tmp_path, capfd,
                       record_property)
    assert counts["refused"] > 0


# --- the tokenizer ------------------------------------------------------------------------


def tokenizer_cases(bases) -> list[tuple[str, str, Mutation]]:
    cases = []
    for arch, base in bases.items():
        tokenizer = json.loads((base / "tokenizer.json").read_text())
        for keys in paths(tokenizer):
            where = ".".join(keys)
            cases.append((arch, f"drop {where}", edit_json("tokenizer.json",
                                                           set_at(keys, None, drop=True))))
            for name, value in VALUES.items():
                cases.append((arch, f"{where}={name}",
                              edit_json("tokenizer.json", set_at(keys, value))))
        for fraction in CUTS:
            cases.append((arch, f"tokenizer cut at {fraction}", cut("tokenizer.json", fraction)))
        cases.append((arch, "no tokenizer", lambda f: (f / "tokenizer.json").unlink()))
        custom = {"tokenizer_class": "XTokenizer",
                  "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}
        cases.append((arch, "tokenizer auto_map", write_json("tokenizer_config.json", custom)))
        for name, value in VALUES.items():
            cases.append((arch, f"tokenizer_class={name}",
                          write_json("tokenizer_config.json", {"tokenizer_class": value})))
    return cases


def write_json(name: str, doc) -> Mutation:
    def mutate(folder: Path) -> None:
        (folder / name).write_text(json.dumps(doc))
    return mutate


def test_hostile_tokenizers_end_in_a_model_or_one_line(bases, tmp_path, capfd,
                                                      record_property):
    counts = run_cases(sample(tokenizer_cases(bases), 120), bases, tmp_path, capfd,
                       record_property)
    assert counts["refused"] > 0


# --- the weights' format ------------------------------------------------------------------

PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "model.pth", "model.ckpt", "weights.pkl")


def weights_cases(bases) -> list[tuple[str, str, Mutation]]:
    def only_pickle(name):
        def mutate(folder: Path) -> None:
            (folder / "model.safetensors").unlink()
            (folder / "pytorch_model.bin").rename(folder / name)
        return mutate

    def index(weight_map) -> Mutation:
        def mutate(folder: Path) -> None:
            (folder / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}))
        return mutate

    cases = []
    for arch in bases:
        cases += [(arch, f"only {name}", only_pickle(name)) for name in PICKLE_NAMES]
        cases.append((arch, "pickle beside safetensors", lambda f: None))
        cases.append((arch, "no weights", lambda f: [(f / n).unlink() for n in (
            "model.safetensors", "pytorch_model.bin")]))
        for shard in ("pytorch_model.bin", "absent.safetensors", "../model.safetensors",
                      "/etc/passwd", "model.safetensors/"):
            cases.append((arch, f"index to {shard}", index({"lm_head.weight": shard})))
        for name, value in VALUES.items():
            cases.append((arch, f"index is {name}", index(value)))
    return cases


def test_weights_as_pickles_or_stray_shards_are_refused_unopened(bases, tmp_path, capfd,
                                                                 record_property):
    counts = run_cases(weights_cases(bases), bases, tmp_path, capfd, record_property)
    assert counts["loaded"] == len(ARCHITECTURES)  # only the pickle beside safetensors


# --- a GGUF file --------------------------------------------------------------------------

# Values of every GGUF scalar kind, and the numbers a size or a rate must not be.
GGUF_VALUES = {"missing": None, "zero": Value(U32, 0), "negative": Value(I32, -1),
               "huge": Value(U64, 2**40), "nan": Value(F32, float("nan")),
               "half": Value(F32, 0.5), "text": Value(STRING, b"no_such_kind"),
               "true": Value(BOOL, True), "empty list": Value(ARRAY, [], U32)}


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory) -> Path:
    from llamakit import tiny_hf, write_tiny_gguf

    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(tiny_hf(seed=7), folder / "tiny.gguf")
    return folder


def gguf_cases(gguf_base: Path) -> list[tuple[str, str, Mutation]]:
    g = parse((gguf_base / "tiny.gguf").read_bytes())

    def rewrite(changed) -> Mutation:
        def mutate(folder: Path) -> None:
            (folder / "tiny.gguf").write_bytes(write(changed))
        return mutate

    cases = []
    for key in g.metadata:
        for name, value in GGUF_VALUES.items():
            cases.append(("gguf", f"{key}={name}", rewrite(g.with_value(key, value))))
    for fraction in CUTS:
        cases.append(("gguf", f"gguf cut at {fraction}", cut("tiny.gguf", fraction)))
    return cases


def test_hostile_gguf_metadata_ends_in_a_model_or_one_line(gguf_base, tmp_path, capfd,
                                                          record_property):
    counts = run_cases(sample(gguf_cases(gguf_base), 50), {"gguf": gguf_base}, tmp_path,
                       capfd, record_property)
    assert counts["refused"] > 0
