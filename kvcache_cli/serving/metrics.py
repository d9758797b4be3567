"""Latency as vLLM's `benchmark_serving` defines it, from each request's timeline.

Per request, from the moment it was sent (its arrival; under `--max-concurrency`,
the moment a slot freed if later) and the time each output token appeared:
- TTFT, time to first token: first token - sent;
- E2E, end-to-end latency: last token - sent;
- TPOT, time per output token: (E2E - TTFT) / (output tokens - 1), requests of
  more than one output token only;
- ITL, inter-token latency: every gap between consecutive tokens; the gaps of all
  requests are pooled before the statistics (one long request weighs more).
A server's stream (`serving.target`) is timed per chunk, as vLLM's client times it: a
chunk may carry several tokens, so its ITL gaps are between chunks and its output
tokens (for TPOT and the throughputs) are the count the server reports.
Over the run (duration: first arrival to last token): request throughput
(requests / s), output throughput (output tokens / s), total token throughput
(prompt + output tokens / s), and goodput: requests / s meeting every given
target (`ttft`, `tpot`, `e2el`, in ms). Percentiles interpolate linearly, as
numpy's (and vLLM's) do. Pure Python and numpy: no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvcache_cli import numbers
from kvcache_cli.serving.sequence import Sequence as Seq

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
# A run meets the targets when at least this share of its requests meets every one
# of them (an SLO attainment target, as DistServe and Sarathi-Serve report).
ATTAINMENT = 0.9


@dataclass(frozen=True)
class Stats:
    """Milliseconds: mean, median, p90, p99 and the largest; nan when empty."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Stats:
        if not values_ms:
            return cls(*(5 * [math.nan]))
        a = np.asarray(values_ms, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))


@dataclass(frozen=True)
class RequestTimes:
    """One request's timeline, seconds on the run's clock."""

    sent: float
    tokens: tuple[float, ...]  # when each output token (a server's: each chunk) appeared
    prompt_tokens: int
    # A server's count of the tokens it streamed (its usage), when chunks are not tokens;
    # None: one token a timestamp.
    output_tokens: int | None = None

    @property
    def n_out(self) -> int:
        return len(self.tokens) if self.output_tokens is None else self.output_tokens

    @property
    def ttft_ms(self) -> float:
        return (self.tokens[0] - self.sent) * 1e3

    @property
    def e2e_ms(self) -> float:
        return (self.tokens[-1] - self.sent) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        n = self.n_out
        return (self.e2e_ms - self.ttft_ms) / (n - 1) if n > 1 else None

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.tokens, self.tokens[1:])]

    def meets(self, targets: Mapping[str, float]) -> bool:
        got = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2e_ms}
        return all(got[k] is None or got[k] <= ms for k, ms in targets.items())


@dataclass(frozen=True)
class Latency:
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    duration_s: float
    requests: int
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # prompt + output tokens / s
    goodput: float | None  # requests / s meeting every target; None without targets
    good_requests: int | None

    @property
    def meets_targets(self) -> bool | None:
        if self.good_requests is None:
            return None
        return self.good_requests >= ATTAINMENT * self.requests


def summarise(times: Sequence[RequestTimes], duration_s: float,
              targets: Mapping[str, float] | None = None) -> Latency:
    tpot = [t.tpot_ms for t in times if t.tpot_ms is not None]
    output = sum(t.n_out for t in times)
    prompt = sum(t.prompt_tokens for t in times)
    good = sum(t.meets(targets) for t in times) if targets else None
    return Latency(
        ttft=Stats.of([t.ttft_ms for t in times]), tpot=Stats.of(tpot),
        itl=Stats.of([gap for t in times for gap in t.itl_ms]),
        e2e=Stats.of([t.e2e_ms for t in times]), duration_s=duration_s,
        requests=len(times), request_throughput=len(times) / duration_s,
        output_throughput=output / duration_s,
        total_token_throughput=(prompt + output) / duration_s,
        goodput=None if good is None else good / duration_s, good_requests=good)


# A latency target past a day, or requests arriving faster than a nanosecond apart, is a
# typing slip: no run measures either.
MAX_TARGET_MS = 86_400_000
MAX_RATE = 1e9


def parse_goodput(text: str) -> dict[str, float]:
    """`"ttft:500,tpot:50"` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    targets: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.partition(":")
        try:
            ms = numbers.decimal(value, "", 0, MAX_TARGET_MS, above=True) if sep else math.nan
        except numbers.NumberError:
            ms = math.nan
        if key not in GOODPUT_KEYS or not ms > 0 or key in targets:
            raise ValueError(
                f"--goodput {text!r}: expected targets like ttft:500,tpot:50 (milliseconds "
                f"more than 0 and at most {MAX_TARGET_MS:,}; keys {', '.join(GOODPUT_KEYS)}, "
                "each at most once)")
        targets[key] = ms
    return targets


def parse_rates(text: str) -> tuple[float | None, ...]:
    """`"4,1,inf,2"` -> (1.0, 2.0, 4.0, None): requests/s, slowest first, None (all at
    once) last: the curve's order."""
    rates: list[float | None] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = (math.inf if part.lower() == "inf"
                    else numbers.decimal(part, "", 0, MAX_RATE, above=True))
        except numbers.NumberError:
            rate = math.nan
        if not rate > 0:
            raise ValueError(f"--rate {text!r}: expected requests/s > 0 and at most "
                             f"{MAX_RATE:,.0f}, comma-separated, inf for all at once, e.g. "
                             "1,2,4,8,inf")
        value = None if math.isinf(rate) else rate
        if value in rates:
            raise ValueError(f"--rate {text!r}: the rate {part} given twice")
        rates.append(value)
    return tuple(sorted(rates, key=lambda x: math.inf if x is None else x))


def shared_hit_rate(seqs: Sequence[Seq], shared_prefix: int, block_size: int) -> float | None:
    """The share of the shared prefix's full blocks that every request admitted after the
    first took from the prefix cache; None without a full block to share or a second one."""
    full = shared_prefix // block_size
    later = sorted((s for s in seqs if s.admitted_hits is not None),
                   key=lambda s: s.request.arrival_s)[1:]
    if not full or not later:
        return None
    return sum(min(s.admitted_hits, full) for s in later) / (full * len(later))
