"""The clock of a serving run: when each request arrived, was first answered and got every
token, from which TTFT, TPOT, ITL and E2E are computed; progress reported as it goes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from kvcache_cli.serving.results import Sample
from kvcache_cli.serving.sequence import Request

# A progress callback: (engine, requests done, requests in all, running, waiting,
# KV bytes in use, KV bytes reserved).
ProgressFn = Callable[[str, int, int, int, int, int, int], None]


class Recorder:
    """Arrivals, token times and memory samples of one engine's run.

    A request is sent when it has arrived and, under a concurrency cap, a slot is
    free: request i waits for the (i - cap + 1)-th finish, and counts its latency
    from then (vLLM's client waits on a semaphore before it sends).
    """

    def __init__(self, engine: str, requests: Sequence[Request], device,
                 progress: ProgressFn | None, max_concurrency: int | None = None):
        self.engine, self.requests, self.device, self.progress = engine, requests, device, progress
        self.max_concurrency = max_concurrency
        self.tokens: dict[int, list[int]] = {}
        self.times: dict[int, list[float]] = {}  # when each output token appeared
        self.sent: dict[int, float] = {}
        self.finish: dict[int, float] = {}
        self.finished_at: list[float] = []  # finish times in the order requests finished
        self.samples: list[Sample] = []
        self.next_arrival = 0  # index of the first request not yet handed in
        self.reserved = 0  # KV bytes the engine holds, for the progress display
        self.t0 = time.perf_counter()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0

    def _slot_free_at(self, i: int) -> float | None:
        """When request i may be sent under the cap; None: not yet."""
        if self.max_concurrency is None or i < self.max_concurrency:
            return 0.0
        k = i - self.max_concurrency  # the (k + 1)-th finish frees its slot
        return self.finished_at[k] if k < len(self.finished_at) else None

    def arrivals(self) -> Iterator[Request]:
        """Requests sent since the last call, in arrival order."""
        now = time.perf_counter() - self.t0
        while self.next_arrival < len(self.requests):
            r = self.requests[self.next_arrival]
            free = self._slot_free_at(self.next_arrival)
            if r.arrival_s > now or free is None:
                break
            self.sent[r.id] = max(r.arrival_s, free)
            self.next_arrival += 1
            yield r

    def wait_for_arrival(self) -> None:
        """Sleep until the next request arrives (only when nothing else can run)."""
        if self.next_arrival < len(self.requests):
            ahead = self.requests[self.next_arrival].arrival_s - (time.perf_counter() - self.t0)
            time.sleep(max(0.0, ahead))

    def token(self, rid: int, t: float) -> None:
        self.times.setdefault(rid, []).append(t)

    def done(self, rid: int, t: float) -> None:
        self.finish[rid] = t
        self.finished_at.append(t)

    @property
    def arrived(self) -> int:
        return self.next_arrival

    def sample(self, running: int, waiting: int, used: int, real: int) -> None:
        self.samples.append(Sample(self.now(), running, waiting, used, real))
        if self.progress is not None:
            self.progress(self.engine, len(self.finish), len(self.requests), running, waiting,
                          used, self.reserved)
