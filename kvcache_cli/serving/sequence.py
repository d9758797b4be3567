"""A request as the engine sees it: its tokens, its block table, its state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class Request:
    """What a client sends: a prompt, how many tokens it wants, and when it arrives."""

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float  # seconds after the workload starts


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not contents: two requests may hold equal tokens
class Sequence:
    """One request in flight.

    `tokens` is the prompt and every token generated so far; the cache holds the
    keys and values of the first `num_cached` of them, in the blocks of
    `block_table` (logical block i of the sequence is pool block block_table[i]).
    A preempted sequence drops its blocks and keeps its tokens: it is recomputed.
    """

    request: Request
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: Status = Status.WAITING

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.prompt) :]

    @property
    def to_compute(self) -> int:
        """Tokens whose keys and values the cache does not hold yet."""
        return len(self.tokens) - self.num_cached

    @property
    def decoding(self) -> bool:
        """Past its prompt: one token to compute, the one it generated last."""
        return self.to_compute == 1 and len(self.tokens) > len(self.request.prompt)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.max_new_tokens
