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
    # A chat reply ends at its end-of-turn token (the last one made) or at max_new_tokens.
    stop_ids: tuple[int, ...] = ()

    def finished(self, generated: list[int]) -> bool:
        """Whether a reply of these tokens is complete: the cap, or a stop token last."""
        return len(generated) >= self.max_new_tokens or bool(
            generated and generated[-1] in self.stop_ids)


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
    # Prefix blocks taken by reference when first admitted (a recomputation's are not
    # counted): how much of a shared system prompt the prefix cache served.
    admitted_hits: int | None = None
    # A hybrid pool's block table per group of layers (`serving.hybrid_blocks`); empty on a
    # pool of one kind, whose table is `block_table`.
    group_tables: list[list[int]] = field(default_factory=list)

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
        return self.request.finished(self.generated)
