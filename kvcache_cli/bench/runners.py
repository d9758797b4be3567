"""Each mode's run under one clock: ours (any cache), the naive loop sampled at a few
steps, transformers' generate(), llama.cpp; every decode step timed on its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache_cli.bench.modes import COMPILE_MODE, cache_of
from kvcache_cli.bench.results import TimedRun
from kvcache_cli.measure import quiet_transformers, synchronize

if TYPE_CHECKING:
    import torch

    from kvcache_cli.models.llama_cpp import LlamaRunner


# The naive loop is timed at this many decode steps spread over the run (0: all).
NAIVE_SAMPLES = 16

# A few untimed tokens per mode pay the one-time costs (lazy initialisation,
# kernel selection, the allocator's first blocks) that would otherwise land in
# the first timed steps; more only makes the naive loop's warm-up slow.
WARMUP_TOKENS = 16


@dataclass
class _Timeline:
    """Clock readings of one run.

    `marks[i]` is read when token i is known on the host; `resumes[i]` when the
    bench's own bookkeeping after it (progress, list appends) is done. Decode
    step i+1 is `marks[i+1] - resumes[i]`: the generator's work only.
    """

    start: float
    marks: list[float]
    resumes: list[float]

    def ttft_ms(self) -> float:
        return (self.marks[0] - self.start) * 1e3

    def step_ms(self) -> list[float]:
        return [(m - r) * 1e3 for m, r in zip(self.marks[1:], self.resumes[:-1], strict=True)]


class _Clock:
    """Reads the clock once per token, after synchronising the device."""

    def __init__(self, device: torch.device, on_token: Callable[[], None]):
        self.device = device
        self.on_token = on_token
        synchronize(device)
        self.timeline = _Timeline(time.perf_counter(), [], [])

    def tick(self) -> None:
        synchronize(self.device)
        self.timeline.marks.append(time.perf_counter())
        self.on_token()
        self.timeline.resumes.append(time.perf_counter())


def _from_timeline(tokens, timeline: _Timeline, held=None, copied=None) -> TimedRun:
    step_ms = timeline.step_ms()
    return TimedRun(tokens, timeline.ttft_ms(), list(range(len(step_ms))), step_ms, held, copied)


def run_ours(
    model, prompt_ids: list[int], new_tokens: int, mode: str, device, on_token, max_len: int,
    forward=None,
) -> TimedRun:
    """`max_len` sizes a static cache: the run's own length, also for a shorter warm-up,
    so a compiled step sees in the warm-up the cache shapes it is timed with. `forward`:
    the compiled step of a `-compiled` mode (`generate.CompiledDecode`), or the replayed
    one of `static-replayed` (`generate.ReplayedDecode`)."""
    from kvcache_cli.caches import make_cache
    from kvcache_cli.generate import stream_tokens

    # The bench owns the cache so it can read what the appends copied afterwards.
    cache = None
    if mode != "naive":
        # Compiled, the cache is read whole under a mask: one shape at every step.
        cache = make_cache(cache_of(mode), model, max_len=max_len, batch=1,
                           whole=mode.endswith("-compiled"))
    tokens: list[int] = []
    clock = _Clock(device, on_token)
    for token in stream_tokens(model, prompt_ids, new_tokens, cache_of(mode), cache=cache,
                               forward=forward):
        clock.tick()
        tokens.append(token)
    if cache is None:
        return _from_timeline(tokens, clock.timeline)
    return _from_timeline(tokens, clock.timeline, cache.bytes_held, cache.bytes_copied)


def run_llama(runner: LlamaRunner, prompt_ids: list[int], new_tokens: int, device,
               on_token) -> TimedRun:  # fmt: skip
    """llama.cpp under the same clock: a tick as each token is known on the host."""
    tokens: list[int] = []
    clock = _Clock(device, on_token)
    for token in runner.stream(prompt_ids, new_tokens):
        clock.tick()
        tokens.append(token)
    return _from_timeline(tokens, clock.timeline)


def run_naive_sampled(
    model, prompt_ids: list[int], reference: list[int], steps: Sequence[int], device, on_token
) -> TimedRun:
    """The naive loop timed at `steps` only: each a full forward over the prompt and the
    reference's tokens before it, as the naive loop would have run it there."""
    import torch

    def next_token(ids: list[int]) -> int:
        idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
        with torch.inference_mode():
            logits = model(idx, 0, None, last_only=True)  # (1, 1, vocab)
        return int(logits[0, -1].argmax().item())  # .item() waits for the device

    def timed(ids: list[int]) -> tuple[int, float]:
        synchronize(device)
        start = time.perf_counter()
        token = next_token(ids)
        synchronize(device)
        ms = (time.perf_counter() - start) * 1e3
        on_token()
        return token, ms

    first, ttft = timed(prompt_ids)
    tokens, step_ms = [first], []
    for step in steps:
        # Decode step `step` chooses token step + 1 after the prompt and tokens 0 .. step.
        token, ms = timed(prompt_ids + reference[: step + 1])
        tokens.append(token)
        step_ms.append(ms)
    return TimedRun(tokens, ttft, list(steps), step_ms, None, None)


def sampled_steps(n_steps: int, samples: int) -> list[int]:
    """`samples` decode steps spread evenly from the first to the last (all if fewer)."""
    if samples <= 0 or samples >= n_steps:
        return list(range(n_steps))
    if samples == 1:
        return [0]
    return sorted({round(j * (n_steps - 1) / (samples - 1)) for j in range(samples)})


def run_hf(
    hf_model, prompt_ids: list[int], new_tokens: int, mode: str, device, on_token,
    stop_after: int | None = None,
) -> TimedRun:  # fmt: skip
    """transformers' `generate()`: greedy, its own KV cache on, the same lengths.

    A stopping criterion is called once per step right after the step's token is
    appended, the same moment `stream_tokens` yields one: it reads the clock there
    and stops nothing, except a warm-up after `stop_after` tokens (the run is still
    set up for `new_tokens`, so a static cache has the timed run's size).
    """
    import torch
    from transformers import (
        CompileConfig,
        GenerationConfig,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    class ClockCriterion(StoppingCriteria):
        def __init__(self, clock: _Clock):
            self.clock = clock
            self.count = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.clock.tick()
            self.count += 1
            stop = stop_after is not None and self.count >= stop_after
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=device)

    ids = torch.tensor([prompt_ids], device=device)
    options: dict = dict(max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                         pad_token_id=0)  # fmt: skip
    if mode.startswith("hf-static"):
        options["cache_implementation"] = "static"
    cache = {}
    if mode == "hf-quanto":  # a fresh one each run: generate() appends to what it is given
        from transformers import QuantizedCache

        from kvcache_cli.eval.peer_hf import cache_keyword

        cache[cache_keyword(hf_model)] = QuantizedCache(backend="quanto",
                                                        config=hf_model.config, nbits=4)
    if mode.endswith("-compiled"):
        compile_config = CompileConfig(mode=COMPILE_MODE[device.type])
        # generate() compiles only on accelerators unless told to compile everywhere.
        compile_config._compile_all_devices = True
        options["compile_config"] = compile_config
    else:
        options["disable_compile"] = True  # eager, even where generate() would compile
    clock = _Clock(device, on_token)
    with quiet_transformers():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=GenerationConfig(**options),
            stopping_criteria=StoppingCriteriaList([ClockCriterion(clock)]),
            **cache,
        )
    return _from_timeline(out[0, len(prompt_ids) :].tolist(), clock.timeline)


def hf_copy(model, device):
    """The same weights as a transformers model, never stopping at an end-of-text token.

    Our modes always produce `new_tokens`; random weights may pick token 50256,
    which generate() would take as the end, and the runs would differ in length.
    """
    from kvcache_cli.models import to_hf

    hf_model = to_hf(model).to(device).eval()
    hf_model.generation_config.eos_token_id = None
    return hf_model
