"""A task the model must answer: a pass key planted in a long filler text, asked for after it.

The pass-key retrieval test (Mohtashami & Jaggi 2023, the "needle in a haystack" kvpress's
users read): a five-digit key stated at a known depth of a repetitive filler, then the
question; the reply, generated greedily through the model's chat template, is correct when
its first number is the key (exact match). Every cache answers the same prompts: the exact
`static` first, which shows whether the model can do the task at all at that length, then
each compressing or bounded kind. The prompt is prefilled as one forward, so a compressing
kind (`snapkv`, `knorm`, `recent`) compresses it once with the question in its last tokens,
which is what SnapKV's observation window is for.

Per cache: accuracy overall, by depth and by length; bytes held per token after the
answer; median prefill, compression and decode times. Nothing here prints.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache_cli import numbers
from kvcache_cli.caches.spec import CacheSpec, check_prompt, parse_cache_spec

INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the pass key.\n\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the key sits in the filler: start .. end
KEYS_PER_CELL = 2  # prompts per (length, depth): different keys, the same filler
MAX_NEW_TOKENS = 12  # "The pass key is 12345." and an end of turn
MAX_LENGTH = 1 << 20  # a filler longer than any model's context: refused before it is built
REFERENCE = "static"
# Without --cache: each compressing kind at a quarter of the prompt's keys.
DEFAULT_CACHES = ("snapkv:0.25", "knorm:0.25", "recent:0.25")


@dataclass(frozen=True)
class Case:
    length: int  # the filler's length asked for, in tokens
    depth: float  # 0: the key first, 1: the key just before the question
    key: str
    message: str  # the user's turn


@dataclass(frozen=True)
class Prompter:
    """How a model is asked: its tokenizer, its chat template (or a plain Q/A layout for a
    model without one) and the ids that end its reply."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    chat: Callable[[str], str]  # the user's message -> the prompt, ready for the reply
    stop_ids: tuple[int, ...]


@dataclass(frozen=True)
class Answer:
    cache: str
    length: int
    depth: float
    key: str
    prompt_tokens: int
    reply: str
    correct: bool
    bytes_held: int  # after the reply
    positions: int
    prefill_ms: float  # compression included
    compress_ms: float
    decode_ms_per_token: float


@dataclass(frozen=True)
class CacheScore:
    cache: str
    accuracy: float
    by_depth: tuple[tuple[float, float], ...]  # (depth, accuracy)
    by_length: tuple[tuple[int, float], ...]  # (length, accuracy)
    bytes_per_token: float  # mean over prompts of bytes held / positions
    bytes_ratio: float  # over the exact cache's
    prefill_ms: float  # medians over prompts
    compress_ms: float
    decode_ms_per_token: float


@dataclass(frozen=True)
class RetrievalResult:
    model: str
    prompter: str
    device: str
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    prompt_tokens: tuple[int, ...]  # per length, the longest prompt (template and question in)
    scores: tuple[CacheScore, ...]  # the exact cache first
    answers: tuple[Answer, ...]

    def score(self, cache: str) -> CacheScore:
        for s in self.scores:
            if s.cache == cache:
                return s
        raise KeyError(f"cache {cache!r} was not run")


# ---------------------------------------------------------------------------- the prompts


def message(units: int, depth: float, key: str) -> str:
    """The user's turn: INTRO, `units` fillers with the needle after round(depth * units)
    of them, the question."""
    before = round(depth * units)
    return (INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before)
            + QUESTION.lstrip(" "))


def cases(lengths: Sequence[int], encode: Callable[[str], list[int]],
          depths: Sequence[float] = DEPTHS, per_cell: int = KEYS_PER_CELL, seed: int = 0
          ) -> tuple[Case, ...]:
    """per_cell prompts for each length (filler tokens) and depth, keys from a seeded RNG."""
    unit = len(encode(FILLER * 8)) / 8  # tokens per filler sentence group, this tokenizer
    rng = random.Random(seed)
    out = []
    for length in lengths:
        units = max(1, round(length / unit))
        for depth in depths:
            for _ in range(per_cell):
                key = str(rng.randrange(10_000, 100_000))
                out.append(Case(length, depth, key, message(units, depth, key)))
    return tuple(out)


def first_number(reply: str) -> str | None:
    found = re.search(r"\d+", reply)
    return found.group() if found else None


def is_correct(reply: str, key: str) -> bool:
    """Exact match: the reply's first number is the key."""
    return first_number(reply) == key


def parse_lengths(text: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024), or a ValueError naming the value. Each is read by
    `numbers` (ASCII digits, bounded: no model's context reaches MAX_LENGTH, and the
    context check that follows names the model's own)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(numbers.is_whole(p) and 0 < int(p) <= MAX_LENGTH for p in parts):
        raise ValueError(f"--lengths {text!r}: expected filler lengths in tokens, "
                         f"comma-separated, each {numbers.span(1, MAX_LENGTH)} (e.g. 512,1024)")
    return tuple(int(p) for p in parts)


def check_fit(lengths: Sequence[int], ids: Sequence[list[int]], context: int) -> None:
    """Refuse prompts that, with a reply, would pass the model's context window."""
    longest = max(len(p) for p in ids)
    if longest + MAX_NEW_TOKENS > context:
        raise ValueError(f"--lengths {max(lengths):,}: a prompt of {longest:,} tokens (the "
                         f"filler with the template and the question) and a reply of "
                         f"{MAX_NEW_TOKENS} pass the model's context window of {context:,} "
                         "positions; expected shorter lengths")


def prompter_for(config) -> Prompter:
    """The model's own chat template and tokenizer when its config has them (SmolLM2-
    Instruct), else its tokenizer and a plain 'Answer:' layout (GPT-2, stdlib-bytes)."""
    tokenizer = config.tokenizer
    if tokenizer.startswith("file:"):
        from kvcache_cli.models.tokenizer import bpe_encoding

        encoding = bpe_encoding(tokenizer.removeprefix("file:"))
    else:
        from kvcache_cli.models.tokenizer import encoding_for

        encoding, why = encoding_for(tokenizer)
        if encoding is None:
            raise RuntimeError(why)
    template = getattr(config, "chat_template", None)
    if template:
        from kvcache_cli.models.chat_template import render_chat

        def chat(text: str) -> str:
            return render_chat(template, [{"role": "user", "content": text}])
        name = "the model's chat template"
    else:
        def chat(text: str) -> str:
            return f"{text}\nAnswer: The pass key is"
        name = "plain text (no chat template)"
    return Prompter(name, encoding.encode, encoding.decode, chat,
                    tuple(getattr(config, "eos_ids", ())))


# ---------------------------------------------------------------------------- the run


def answer(model, ids: list[int], spec: CacheSpec, prompter: Prompter, case: Case,
           max_new: int = MAX_NEW_TOKENS) -> Answer:
    """One prompt through one cache: prefilled in one forward, then a greedy reply."""
    import torch

    from kvcache_cli.caches import make_cache
    from kvcache_cli.measure import synchronize

    device = model.device
    cache = make_cache(spec, model, len(ids) + max_new)
    x = torch.tensor([ids], device=device)  # (1, P)
    synchronize(device)
    began = time.perf_counter()
    logits = model(x, 0, cache, last_only=True)  # (1, 1, vocab)
    synchronize(device)
    prefill_ms = (time.perf_counter() - began) * 1e3
    reply: list[int] = []
    steps: list[float] = []
    pos = len(ids)
    for _ in range(max_new):
        token = int(logits[0, -1].argmax())
        if token in prompter.stop_ids:
            break
        reply.append(token)
        if len(reply) == max_new:
            break
        began = time.perf_counter()
        logits = model(torch.tensor([[token]], device=device), pos, cache)  # (1, 1, vocab)
        synchronize(device)
        steps.append((time.perf_counter() - began) * 1e3)
        pos += 1
    text = prompter.decode(reply)
    return Answer(str(spec), case.length, case.depth, case.key, len(ids), text,
                  is_correct(text, case.key), cache.bytes_held, cache.length, prefill_ms,
                  getattr(cache, "compress_ms", 0.0),
                  statistics.median(steps) if steps else float("nan"))


def prompts(prompter: Prompter, lengths: Sequence[int], depths: Sequence[float] = DEPTHS,
            per_cell: int = KEYS_PER_CELL) -> tuple[tuple[Case, ...], tuple[list[int], ...]]:
    """The cases and their prompts' ids, through the model's chat template."""
    todo = cases(lengths, prompter.encode, depths, per_cell)
    return todo, tuple(prompter.encode(prompter.chat(c.message)) for c in todo)


def specs_to_run(specs: Sequence[str | CacheSpec], ids: Sequence[list[int]]
                 ) -> list[CacheSpec]:
    """The exact cache first, then each spec once; a compressing kind whose budget or
    window the shortest prompt cannot fill is refused (CacheSpecError) before any run."""
    parsed = [parse_cache_spec(REFERENCE)]
    for s in specs:
        s = parse_cache_spec(s) if isinstance(s, str) else s
        if str(s) not in {str(p) for p in parsed}:
            parsed.append(s)
    for spec in parsed:
        check_prompt(spec, min(len(p) for p in ids))
    return parsed


def run_retrieval(model, prompter: Prompter, specs: Sequence[str | CacheSpec],
                  lengths: Sequence[int], *, depths: Sequence[float] = DEPTHS,
                  per_cell: int = KEYS_PER_CELL, model_name: str = "",
                  progress: Callable[[int, int], None] | None = None) -> RetrievalResult:
    """Every case through the exact cache, then through each spec (in order, once each)."""
    import torch

    todo, ids = prompts(prompter, lengths, depths, per_cell)
    check_fit(lengths, ids, model.config.context)
    parsed = specs_to_run(specs, ids)
    answers = []
    with torch.inference_mode():
        # One untimed prompt first: the first forward pays one-time costs.
        answer(model, ids[0], parsed[0], prompter, todo[0], max_new=1)
        for i, (case, prompt) in enumerate(zip(todo, ids, strict=True)):
            answers += [answer(model, prompt, spec, prompter, case) for spec in parsed]
            if progress is not None:
                progress(i + 1, len(todo))
    longest = tuple(max(len(p) for p, c in zip(ids, todo, strict=True) if c.length == n)
                    for n in lengths)
    return RetrievalResult(model_name, prompter.name, str(model.device), tuple(lengths),
                           tuple(depths), longest, _scores(answers, parsed), tuple(answers))


def _scores(answers: list[Answer], specs: list[CacheSpec]) -> tuple[CacheScore, ...]:
    def mean_correct(rows: list[Answer]) -> float:
        return statistics.fmean(a.correct for a in rows)

    out = []
    for spec in specs:
        rows = [a for a in answers if a.cache == str(spec)]
        depths = sorted({a.depth for a in rows})
        lengths = sorted({a.length for a in rows})
        out.append(CacheScore(
            cache=str(spec), accuracy=mean_correct(rows),
            by_depth=tuple((d, mean_correct([a for a in rows if a.depth == d])) for d in depths),
            by_length=tuple((n, mean_correct([a for a in rows if a.length == n]))
                            for n in lengths),
            bytes_per_token=statistics.fmean(a.bytes_held / a.positions for a in rows),
            bytes_ratio=1.0,
            prefill_ms=statistics.median(a.prefill_ms for a in rows),
            compress_ms=statistics.median(a.compress_ms for a in rows),
            decode_ms_per_token=statistics.median(a.decode_ms_per_token for a in rows),
        ))  # fmt: skip
    exact = out[0].bytes_per_token
    return tuple(
        CacheScore(**{**s.__dict__, "bytes_ratio": s.bytes_per_token / exact}) for s in out)
