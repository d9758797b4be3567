"""NVIDIA kvpress's presses on the same model, as `kvcache eval` rows.

kvpress compresses the prompt's cache once, at prefill, as kvcache's snapkv, knorm and
recent kinds do; these rows run its presses on transformers' model of the same weights,
on the same ids, scored against transformers' exact DynamicCache as kvcache's rows are
against `static`. kvpress pins transformers below 5.3 and kvcache runs a newer one, so it
lives in a venv of its own (scripts/kvpress_venv.sh) and runs there as a subprocess
(`eval.kvpress_runner`, JSON in and out); nothing here imports it.

Spec (the `--cache` grammar's conventions). R is kvcache's ratio, the share of the
prompt's keys kept (kvpress's `compression_ratio` is the share removed: 1 - R):

    kvpress:snapkv:R[:wN][:kN]   SnapKVPress: window N (default 32), pooling kernel N
                                 (default 7), as kvcache's snapkv; kvpress pools by
                                 average, so its twin is snapkv:R:avg
    kvpress:knorm:R              KnormPress, kvcache's knorm:R
    kvpress:recent:R[:sN]        StreamingLLMPress: the first N (default 0) and the newest
                                 keys, kvcache's recent:R:sN
    kvpress:expected:R[:sN]      ExpectedAttentionPress (kvpress's own; kvcache has no twin),
                                 N sinks kept (default 4, kvpress's)

A model kvpress does not hook (Gemma 3's text model, whose sliding layers it would
compress as full ones; GPT-2) is refused by the runner with kvpress's reason, one line a
cache under the table, not a crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache_cli.eval.kvpress_runner import REFERENCE

NAME = "kvpress"
SCRIPT = "bash scripts/kvpress_venv.sh install"
# The spec's kind -> (kvpress's press, the fields it takes: letter -> (keyword, default)).
KINDS = {"snapkv": ("SnapKVPress", {"w": ("window_size", 32), "k": ("kernel_size", 7)}),
         "knorm": ("KnormPress", {}),
         "recent": ("StreamingLLMPress", {"s": ("n_sink", 0)}),
         "expected": ("ExpectedAttentionPress", {"s": ("n_sink", 4)})}
GRAMMAR = (f"kvpress:KIND:R ({', '.join(KINDS)}; R the share of the prompt's keys kept, "
           "in (0, 1]), then snapkv's :wN :kN or recent's and expected's :sN")


@dataclass(frozen=True)
class KvpressSpec:
    kind: str  # KINDS key
    keep: float  # share of the prompt's keys kept: kvcache's ratio
    fields: tuple[tuple[str, int], ...] = ()  # (letter, value), KINDS' order, every one

    def __str__(self) -> str:
        return f"{NAME}:{self.kind}:{self.keep!r}" + "".join(f":{k}{v}" for k, v in self.fields)

    def press(self) -> dict:
        """What the runner builds: kvpress's class and its keyword arguments."""
        press, own = KINDS[self.kind]
        kwargs = {own[letter][0]: value for letter, value in self.fields}
        return {"name": str(self), "press": press,
                "kwargs": {"compression_ratio": round(1 - self.keep, 12), **kwargs}}


def is_kvpress(text: str) -> bool:
    return text.strip().split(":", 1)[0].lower() == NAME


def parse_kvpress(text: str) -> KvpressSpec:
    """'kvpress:snapkv:0.25:w16' -> KvpressSpec, or a ValueError naming the spec."""
    spec = text.strip()
    _, *fields = spec.lower().split(":")
    if not fields or fields[0] not in KINDS:
        raise ValueError(f"cache spec {spec!r}: expected {GRAMMAR}, e.g. kvpress:snapkv:0.25")
    own = KINDS[fields[0]][1]
    if len(fields) < 2 or not _is_share(fields[1]):
        raise ValueError(f"cache spec {spec!r}: expected a share of the prompt's keys to keep "
                         f"in (0, 1] after {fields[0]}, e.g. kvpress:{fields[0]}:0.25 "
                         "(kvpress takes a ratio, not a count of tokens)")
    given: dict[str, int] = {}
    for f in fields[2:]:
        letter, number = f[:1], f[1:]
        if letter not in own or not number.isascii() or not number.isdigit():
            what = ", ".join(f":{k}N" for k in own) or "none"
            raise ValueError(f"cache spec {spec!r}: unknown field {f!r}; {fields[0]} takes "
                             f"{what}")
        if letter in given:
            raise ValueError(f"cache spec {spec!r}: {letter}N given twice")
        given[letter] = int(number)
    if given.get("k", 1) % 2 == 0 or given.get("w", 1) < 1:
        raise ValueError(f"cache spec {spec!r}: expected a window of at least 1 and an odd "
                         "pooling kernel (e.g. w32:k7)")
    values = tuple((k, given.get(k, default)) for k, (_, default) in own.items())
    return KvpressSpec(fields[0], float(fields[1]), values)


def _is_share(text: str) -> bool:
    from kvcache_cli import numbers

    return "." in text and numbers.is_decimal(text) and 0 < float(text) <= 1


def venv_python() -> Path:
    """The kvpress venv's Python (where scripts/kvpress_venv.sh puts it; the same
    settings), whether or not it is there."""
    from kvcache_cli.models.gguf.converted import cache_root

    venv = os.environ.get("KVCACHE_KVPRESS_VENV") or cache_root() / "kvpress-venv"
    return Path(venv) / "bin" / "python"


def check_installed(specs: Sequence[KvpressSpec], config, model: str) -> None:
    """Refuse kvpress rows that cannot run, before any weights load: no venv, or a Llama
    not read from a GGUF (whose transformers folder kvcache writes for the runner)."""
    if not specs:
        return
    if not venv_python().is_file():
        raise ValueError(f"cache {str(specs[0])!r} runs kvpress in a venv of its own, and "
                         f"there is none at {venv_python().parent.parent}: {SCRIPT}")
    from kvcache_cli.models import family_of

    if family_of(model) == "llama" and getattr(config, "gguf", None) is None:
        raise ValueError(f"cache {str(specs[0])!r} runs transformers' Llama on the model's "
                         f"GGUF; --model {model} was not read from one (expected -m smollm2 "
                         "or a .gguf)")


def evaluate(model, tokens: Sequence[int], specs: Sequence[KvpressSpec], *,
             prompt_len: int, threads: int, progress: Callable[[int, int], None] | None = None
             ) -> tuple[tuple, tuple[str, ...]]:
    """(the rows: kvpress's exact DynamicCache, then each press; the refusals, one line a
    cache) from one run of the runner in kvpress's venv on `tokens`."""
    from kvcache_cli.models.gguf.hf_export import export

    architecture = _architecture(model)
    # transformers' names for what each layer attends over (a Llama's: all full).
    kinds = ["sliding_attention" if t.sliding else "full_attention"
             for t in getattr(model.config, "layer_types", ())]
    # Only a Llama is run (kvpress hooks no other family kvcache has): its folder, from
    # the GGUF `check_installed` asked for.
    folder = export(model.config.gguf).path if architecture == "LlamaForCausalLM" else ""
    job = {"architecture": architecture, "ids": list(tokens), "prompt_len": prompt_len,
           "threads": threads, "presses": [s.press() for s in dict.fromkeys(specs)],
           "layer_types": kinds, "model": str(folder)}
    total = len(tokens) - prompt_len
    if progress is not None:
        progress(0, total)
    out = run_runner(job)
    if progress is not None:
        progress(total, total)
    if out["refused"]:
        from kvcache_cli.eval.quality import Refusal

        return (), tuple(Refusal(str(s), NAME, out["refused"]) for s in dict.fromkeys(specs))
    return rows_from(out["rows"], prompt_len), ()


def _architecture(model) -> str:
    """transformers' class of the same family (`models.to_hf`'s): what kvpress is asked
    about."""
    from kvcache_cli.models.gemma3 import Gemma3
    from kvcache_cli.models.llama import Llama

    if isinstance(model, Gemma3):
        return "Gemma3ForCausalLM"
    return "LlamaForCausalLM" if isinstance(model, Llama) else "GPT2LMHeadModel"


def run_runner(job: dict) -> dict:
    """The runner's JSON for `job`, run by the venv's Python with this kvcache on its path,
    or a RuntimeError with the end of what it said."""
    import kvcache_cli

    root = str(Path(kvcache_cli.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")])),
        "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(venv_python()), "-m", "kvcache_cli.eval.kvpress_runner"],
                          input=json.dumps(job), capture_output=True, text=True, env=env,
                          check=False)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"kvpress's runner failed ({venv_python()}): {said[0]}")
    return json.loads(done.stdout)


def rows_from(rows: Sequence[dict], prompt_len: int) -> tuple:
    """The runner's rows as eval's CacheQuality rows, scored against kvpress's exact one."""
    from kvcache_cli.eval.quality import Tally, summarise

    tallies = [Tally(r["name"], _Held(r["bytes_held"], r["positions"]), nll=r["nll"],
                     kl=r["kl"], agree=r["agree"], step_ms=r["step_ms"],
                     prefill_ms=r["prefill_ms"]) for r in rows]
    return tuple(dataclasses.replace(row, against=REFERENCE, peer=NAME)
                 for row in summarise(tallies, prompt_len))


@dataclass(frozen=True)
class _Held:
    """What the runner said a cache holds, as eval counts a cache."""

    bytes_held: int
    length: int

