"""The seeded workload every engine serves: prompts, output lengths, arrival times.

Prompts are random token ids (speed and exactness do not depend on what they say),
each a shared prefix (a system prompt, the same for every request) and a user part
of a length drawn from a range; output lengths are drawn from another. Arrivals
are all at once (the offline-throughput case) or, as vLLM's benchmark draws them, a
gamma process at `rate` requests/s whose shape is `burstiness` (1: Poisson; below 1
burstier, above 1 more even). `max_concurrency` caps the requests in flight: a
request is sent when it has arrived and a slot is free (the engines' clocks).
Standard library only: a bad workload is refused before torch loads.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from kvcache_cli import numbers
from kvcache_cli.serving.sequence import Request

# What one run can do: every request is generated once per engine and checked against its
# solo generation, so past this many a run takes days on a CPU and minutes to set up.
MAX_REQUESTS = 100_000
# Lengths are checked against the context window after parsing; this bounds the text.
MAX_LENGTH = 1 << 20
# The arrivals of a workload at a --rate span about requests / rate seconds; past an hour
# the run is waiting, not serving (and a rate near 0 would sleep past the platform's clock).
MAX_ARRIVAL_SPAN_S = 3600


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int
    prompt_len: tuple[int, int]  # the user part, inclusive range, after the shared prefix
    output_len: tuple[int, int]  # inclusive range
    shared_prefix: int
    rate: float | None  # requests/s; None: all arrive at once
    seed: int
    burstiness: float = 1.0  # the gamma shape of the gaps between arrivals
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    # "random" ids, or "chat": prompts made by a chat template (`serving.chat`), whose
    # shared_prefix is the system turn's tokens, prompt_len the rest's range, and whose
    # replies end at a stop token or at output_len[1].
    kind: str = "random"
    stop_ids: tuple[int, ...] = ()
    source: str | None = None  # a chat workload's prompt set: "the shipped set" or a file

    @property
    def longest(self) -> int:
        """Positions the longest possible request occupies: prompt + output."""
        return self.shared_prefix + self.prompt_len[1] + self.output_len[1]


def parse_range(text: str, option: str) -> tuple[int, int]:
    """`"16:512"` -> (16, 512); `"64"` -> (64, 64)."""
    lo, sep, hi = text.strip().partition(":")
    if not numbers.is_whole(lo) or (sep and not numbers.is_whole(hi)):
        raise ValueError(f"{option} {text!r}: expected MIN:MAX or N, e.g. 16:512")
    bounds = (int(lo), int(hi) if sep else int(lo))
    if bounds[1] > MAX_LENGTH:
        raise ValueError(f"{option} {text!r}: expected tokens {numbers.span(1, MAX_LENGTH)}")
    if bounds[0] < 1 or bounds[0] > bounds[1]:
        raise ValueError(f"{option} {text!r}: expected 1 <= MIN <= MAX")
    return bounds


def check_spec(spec: WorkloadSpec, window: int) -> None:
    if not 1 <= spec.requests <= MAX_REQUESTS:
        raise ValueError(f"--requests {spec.requests}: expected a whole number "
                         f"{numbers.span(1, MAX_REQUESTS)}")
    if spec.shared_prefix < 0:
        raise ValueError(f"--shared-prefix {spec.shared_prefix}: expected 0 or more tokens")
    if spec.rate is not None and spec.rate <= 0:
        raise ValueError(f"--rate {spec.rate:g}: expected requests/s > 0 (omit it: all at once)")
    if spec.rate is not None and spec.requests / spec.rate > MAX_ARRIVAL_SPAN_S:
        least = spec.requests / MAX_ARRIVAL_SPAN_S
        raise ValueError(
            f"--rate {spec.rate:g}: {spec.requests:,} requests would arrive over about "
            f"{spec.requests / spec.rate:,.0f} s; expected at least {least:.3g} requests/s "
            f"(the workload's arrivals within {MAX_ARRIVAL_SPAN_S:,} s)")
    if not spec.burstiness > 0 or spec.burstiness == float("inf"):
        raise ValueError(f"--burstiness {spec.burstiness}: expected a gamma shape > 0 "
                         "(1: Poisson)")
    if spec.max_concurrency is not None and spec.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {spec.max_concurrency}: expected at least 1 "
                         "request in flight (omit it: no cap)")
    if spec.longest > window and spec.kind == "chat":
        raise ValueError(
            f"the longest chat request, a shared system turn of {spec.shared_prefix} + a user "
            f"turn of {spec.prompt_len[1]} + a reply cap (--output-len) of "
            f"{spec.output_len[1]} = {spec.longest} positions, is past the context window "
            f"{window}")
    if spec.longest > window:
        raise ValueError(
            f"the longest request, shared prefix {spec.shared_prefix} + prompt "
            f"{spec.prompt_len[1]} + output {spec.output_len[1]} = {spec.longest} positions, "
            f"is past the context window {window}")


def make_requests(spec: WorkloadSpec, vocab_size: int,
                  prompts: tuple[Request, ...] | None = None) -> tuple[Request, ...]:
    """The seeded random requests, or `prompts` (a chat workload's), timed by the spec."""
    if prompts is None:
        rng = random.Random(spec.seed)
        prefix = [rng.randrange(vocab_size) for _ in range(spec.shared_prefix)]
        prompts = []
        for i in range(spec.requests):
            user = [rng.randrange(vocab_size) for _ in range(rng.randint(*spec.prompt_len))]
            prompts.append(Request(i, tuple(prefix + user), rng.randint(*spec.output_len), 0.0))
    return with_arrivals(prompts, spec)


def with_arrivals(requests, spec: WorkloadSpec) -> tuple[Request, ...]:
    """The requests arriving at the spec's rate (all at once without one)."""
    # The gaps come from a stream of their own: every rate serves the same requests.
    gaps = random.Random(f"{spec.seed}:arrivals")
    out, t = [], 0.0
    for i, r in enumerate(requests):
        if spec.rate is not None and i > 0:
            # Mean 1 / rate whatever the shape; shape 1 is the exponential (Poisson).
            t += gaps.gammavariate(spec.burstiness, 1 / (spec.rate * spec.burstiness))
        out.append(dataclasses.replace(r, arrival_s=t))
    return tuple(out)
