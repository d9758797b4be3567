"""The pool under grouped-query attention: what fewer KV heads buy a serving engine.

A token's keys and values cost 2 x layers x KV heads x head size x dtype bytes, so a
model with 3 KV heads (SmolLM2) fits more tokens in the same pool than one with 12
(GPT-2 small): more sequences admitted at once, fewer preemptions when the pool is
small. The figures come from replaying the scheduler (prefill-first, prefix sharing on)
on the run's own requests and replies: the scheduler and the block manager never see a
tensor, so the replay is exact and costs no forward. Each model's pool is the same
bytes; only the bytes a token differ. Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs
from dataclasses import dataclass

from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.scheduler import Scheduler
from kvcache_cli.serving.sequence import Request, Sequence

MIB = 1 << 20
# The small pool holds about this share of the workload's tokens at the served model's
# bytes a token (whole blocks): small enough that the scheduler must preempt.
SMALL_SHARE = 4


@dataclass(frozen=True)
class Replay:
    """One pool size, one model's bytes a token."""

    pool_tokens: int  # blocks x block size
    peak_running: int | None  # the largest batch admitted; None: the longest request does not fit
    preemptions: int | None


@dataclass(frozen=True)
class PoolFigures:
    bytes_per_token: int
    gpt2_bytes_per_token: int  # GPT-2 small's, the same dtype
    tokens_per_mib: float
    gpt2_tokens_per_mib: float
    pool_bytes: int  # the run's --kv-mem
    at_pool: Replay
    gpt2_at_pool: Replay
    small_pool_bytes: int
    at_small: Replay
    gpt2_at_small: Replay


def replay(requests: Seqs[Request], replies: dict[int, list[int]], n_blocks: int,
           block_size: int, max_batch: int) -> Replay:
    """Every request, all at once, through the scheduler, each reply its known tokens."""
    longest = max(len(r.prompt) + len(replies[r.id]) for r in requests)
    if n_blocks * block_size < longest or n_blocks < 1:
        return Replay(n_blocks * block_size, None, None)
    blocks = BlockManager(n_blocks, block_size, prefix_sharing=True)
    scheduler = Scheduler(blocks, max_batch)
    for r in requests:
        scheduler.add(Sequence(r))
    peak = 0
    while not scheduler.idle:
        step = scheduler.schedule()
        ran = list(step.prefill) + list(step.decode)
        for s in ran:  # what a forward does to the bookkeeping, without the forward
            s.num_cached = len(s.tokens)
            s.tokens.append(replies[s.request.id][len(s.generated)])
            if step.decode and s.num_cached % block_size == 0:
                blocks.register_full_blocks(s, s.num_cached)
        peak = max(peak, len(scheduler.running))
        for s in [s for s in scheduler.running if len(s.generated) == len(replies[s.request.id])]:
            scheduler.finish(s)
    return Replay(n_blocks * block_size, peak, scheduler.preemptions)


def figures(requests: Seqs[Request], replies: dict[int, list[int]], bytes_per_token: int,
            gpt2_bytes_per_token: int, pool_bytes: int, block_size: int,
            max_batch: int) -> PoolFigures:
    lengths = [len(r.prompt) + len(replies[r.id]) for r in requests]
    # Twice the longest request at least: GPT-2 small's bytes (1.6x SmolLM2's) still fit it.
    tokens = max(sum(lengths) // SMALL_SHARE, 2 * max(lengths))
    small = -(-tokens // block_size) * block_size * bytes_per_token  # whole blocks

    def at(pool: int, per_token: int) -> Replay:
        return replay(requests, replies, pool // (per_token * block_size), block_size,
                      max_batch)

    return PoolFigures(
        bytes_per_token=bytes_per_token, gpt2_bytes_per_token=gpt2_bytes_per_token,
        tokens_per_mib=MIB / bytes_per_token, gpt2_tokens_per_mib=MIB / gpt2_bytes_per_token,
        pool_bytes=pool_bytes, at_pool=at(pool_bytes, bytes_per_token),
        gpt2_at_pool=at(pool_bytes, gpt2_bytes_per_token), small_pool_bytes=small,
        at_small=at(small, bytes_per_token), gpt2_at_small=at(small, gpt2_bytes_per_token))
