"""Speculative decoding's two rollback breaks: a loop that keeps the rejected keys and
values (`no-rollback`), and a paged rollback that frees a block another sequence still
reads (`rollback-shared`); each beside its fix, with the registry's runners."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.breaks.base import DEFAULT_PROMPT_IDS
from kvcache_cli.caches import RollbackError
from kvcache_cli.generate import check_request
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.speculative.decode import plain_greedy, speculate
from kvcache_cli.speculative.drafts import Draft, LookupDraft, make_draft, parse_draft

SPEC_BREAKS = {
    "no-rollback": "speculative decoding that keeps the rejected keys and values",
    "rollback-shared": "a paged rollback that frees a block another sequence still reads",
}


@dataclass(frozen=True)
class NoRollbackResult:
    name: str
    bug: str
    cache: str
    draft: str
    k: int
    prompt_ids: tuple[int, ...]
    correct: tuple[int, ...]  # plain greedy
    fixed: tuple[int, ...]  # speculative, with the rollback
    broken: tuple[int, ...]  # speculative, without it
    first_divergence: int | None  # first step where broken leaves plain greedy
    acceptance_fixed: float
    acceptance_broken: float
    immune: tuple[str, ...]  # kinds that write at explicit positions: see run_no_rollback


def run_no_rollback(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int = 24,
                    draft: Draft | None = None, k: int = 4, cache: str = "concat"
                    ) -> NoRollbackResult:
    """The target's cache keeps every rejected token: later keys sit at the wrong place.

    On `concat` (the article's cache) the next verification appends after the rejected
    keys, so every later query attends to tokens that were never part of the text. A
    static or paged cache writes at explicit positions and reads only up to the newest
    one: the next verification overwrites the rejected slots, so there resetting the
    length is the whole rollback, and forgetting it breaks nothing (gpt-fast relies on it).
    """
    draft = draft if draft is not None else LookupDraft()
    correct, _ = plain_greedy(model, prompt_ids, max_new_tokens, "static")
    fixed = speculate(model, prompt_ids, max_new_tokens, draft, k, cache=cache)
    broken = speculate(model, prompt_ids, max_new_tokens, draft, k, cache=cache, rollback=False)
    first = next((i for i, (a, b) in enumerate(zip(correct, broken.tokens)) if a != b), None)
    return NoRollbackResult(
        name="no-rollback", bug=SPEC_BREAKS["no-rollback"], cache=cache, draft=draft.name,
        k=k, prompt_ids=tuple(prompt_ids), correct=correct, fixed=fixed.tokens,
        broken=broken.tokens, first_divergence=first,
        acceptance_fixed=fixed.acceptance_rate, acceptance_broken=broken.acceptance_rate,
        immune=("static", "paged"),
    )


@dataclass(frozen=True)
class SharedRollbackResult:
    name: str
    bug: str
    cache: str  # the pool's spec, paged:bN
    block_size: int
    shared_block: int  # the block A and B both hold when B rolls back
    reader_solo: tuple[int, ...]  # A's tokens decoded alone
    reader_fixed: tuple[int, ...]  # A's tokens when B's rollback drops its reference
    reader_broken: tuple[int, ...]  # ... when B's rollback frees the block
    first_divergence: int | None  # first step where the broken run leaves A's solo tokens
    third_admitted_fixed: bool  # whether C found blocks for its prompt
    third_admitted_broken: bool
    refused: str  # what the correct trim says to a rollback that cuts into a shared block


def _free_ignoring_refcount(manager, seq, n_tokens: int) -> None:
    """The broken trim: every block past n_tokens goes back to the free list, whoever
    else still holds it."""
    keep = manager.blocks_for(n_tokens)
    for block in reversed(seq.block_table[keep:]):
        manager.refcount[block] = 0
        manager.free_blocks.append(block)
    del seq.block_table[keep:]
    seq.num_cached = n_tokens


def run_rollback_shared(model: FamilyModel, max_new_tokens: int = 12, block_size: int = 4,
                        seed: int = 0) -> SharedRollbackResult:
    """Two sequences share prefix blocks in one pool; B rolls back into them.

    A's prompt fills three blocks and a bit (its whole generation reserved up front); B's
    prompt is A's first three blocks plus two tokens of its own, so B takes those three
    blocks by reference. B then rolls back to two blocks (a rewound turn, a rejected
    branch), and a third request C asks for two blocks. The correct trim drops B's
    reference to block 2, which A keeps: only B's own block comes back, and C waits. The
    broken one frees block 2 as well: C is admitted into it and its prompt's keys
    overwrite A's positions 8..11 while A still reads them: A leaves its solo tokens.
    """
    from kvcache_cli.caches.paged import PagedCache
    from kvcache_cli.serving.block_manager import BlockManager
    from kvcache_cli.serving.pooled import PooledSequence
    from kvcache_cli.serving.sequence import Request
    from kvcache_cli.serving.sequence import Sequence as Seq

    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt_a = torch.randint(0, V, (3 * block_size + 1,), generator=g).tolist()
    prompt_b = prompt_a[: 3 * block_size] + torch.randint(0, V, (2,), generator=g).tolist()
    prompt_c = torch.randint(0, V, (2 * block_size,), generator=g).tolist()
    check_request(model, prompt_a, max_new_tokens)
    solo, _ = plain_greedy(model, prompt_a, max_new_tokens, "static")
    a_blocks = -(-(len(prompt_a) + max_new_tokens) // block_size)

    def run(trim) -> tuple[tuple[int, ...], int, bool]:
        # A's blocks and B's one block of its own, none spare: whatever a rollback
        # frees is all a newcomer can get.
        manager = BlockManager(a_blocks + 1, block_size, prefix_sharing=True)
        pool = PagedCache(model.config.cache_shape, a_blocks + 1, block_size, model.device,
                          model.dtype)
        seqs = [Seq(Request(i, tuple(p), max_new_tokens, 0.0))
                for i, p in enumerate((prompt_a, prompt_b, prompt_c))]
        a, b, c = seqs
        cache_a, cache_b, cache_c = (PooledSequence(pool, manager, s) for s in seqs)

        def prefill(seq, cache) -> Tensor:
            idx = torch.tensor([seq.tokens[seq.num_cached:]], device=model.device)  # (1, T)
            return model(idx, seq.num_cached, cache, last_only=True)[0, -1]  # (vocab,)

        with torch.inference_mode():
            manager.allocate(a)
            manager.reserve(a, len(prompt_a) + max_new_tokens)
            out = [int(prefill(a, cache_a).argmax())]
            manager.allocate(b)  # a prefix hit: A's first three blocks, by reference
            shared = b.block_table[2]
            prefill(b, cache_b)
            trim(manager, b, 2 * block_size)
            admitted = manager.can_allocate(c)
            if admitted:
                manager.allocate(c)
                prefill(c, cache_c)
            while len(out) < max_new_tokens:
                idx = torch.tensor([[out[-1]]], device=model.device)  # (1, 1)
                logits = model(idx, len(prompt_a) + len(out) - 1, cache_a, last_only=True)
                out.append(int(logits[0, -1].argmax()))
        return tuple(out), shared, admitted

    fixed, shared, admitted_fixed = run(lambda m, s, n: m.trim(s, n))
    broken, _, admitted_broken = run(_free_ignoring_refcount)
    first = next((i for i, (x, y) in enumerate(zip(solo, broken)) if x != y), None)
    return SharedRollbackResult(
        name="rollback-shared", bug=SPEC_BREAKS["rollback-shared"],
        cache=f"paged:b{block_size}", block_size=block_size,
        shared_block=shared, reader_solo=solo, reader_fixed=fixed, reader_broken=broken,
        first_divergence=first, third_admitted_fixed=admitted_fixed,
        third_admitted_broken=admitted_broken, refused=_refusal(block_size),
    )


def _refusal(block_size: int) -> str:
    """What the correct trim answers when a rollback would cut into a shared block."""
    from kvcache_cli.serving.block_manager import BlockManager
    from kvcache_cli.serving.sequence import Request
    from kvcache_cli.serving.sequence import Sequence as Seq

    manager = BlockManager(4, block_size)
    tokens = tuple(range(2 * block_size + 1))
    a, b = Seq(Request(0, tokens, 1, 0.0)), Seq(Request(1, tokens, 1, 0.0))
    manager.allocate(a)
    manager.allocate(b)  # shares a's first two blocks
    b.num_cached = len(tokens)
    try:
        manager.trim(b, block_size + 1)
    except RollbackError as error:
        return str(error)
    return ""


def no_rollback(name: str, model, max_new_tokens: int = 16, progress=None):
    """The target's first half drafts for it: every step proposes K tokens, and the
    rejected ones are what the broken loop keeps."""
    half = model.config.n_layer // 2
    prompt = [t % model.config.vocab_size for t in DEFAULT_PROMPT_IDS]
    draft = (make_draft(parse_draft(f"layers:{half}"), model, len(prompt) + max_new_tokens)
             if half else LookupDraft())
    return run_no_rollback(model, prompt, max_new_tokens, draft)


def rollback_shared(name: str, model, max_new_tokens: int = 16, progress=None):
    return run_rollback_shared(model, max_new_tokens)
