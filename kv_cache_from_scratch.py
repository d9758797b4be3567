#!/usr/bin/env python3
"""The KV cache from scratch: a toy decoder, two generation loops, and the arithmetic.

A 2-layer decoder with random weights (NumPy, float64) generates tokens two ways:
naively, re-running the whole prefix every step, and with a cache of every
layer's keys and values. The causal mask is what makes the cache legal: with it,
token i's key and value never change once computed, so they may be memoised.

Seven demos show what follows (compute, exactness, the mask, memory, GQA,
arithmetic intensity, paged storage); five breaks show what goes wrong when one
piece is removed. Every demo and break returns a frozen dataclass of raw
numbers; `main()` prints them as plain text, and the `kvcache` CLI renders the
same objects with rich or as JSON.

    python3 kv_cache_from_scratch.py                 # every demo, then every break
    python3 kv_cache_from_scratch.py --demo mask     # one demo
    python3 kv_cache_from_scratch.py --break no-mask # one break
    python3 kv_cache_from_scratch.py --list

NumPy and the standard library only. Shape letters: T tokens, C = d_model,
nh heads, hs = head_dim, V vocab.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    n_layers: int = 2
    n_heads: int = 4
    d_model: int = 32       # head_dim = d_model / n_heads = 8
    d_ff: int = 128         # the usual 4 x d_model
    vocab_size: int = 64    # enough distinct tokens to see repetition, small enough to print
    max_ctx: int = 128      # rows in the learned position table: the hard context window
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class Model:
    cfg: Config
    emb: np.ndarray         # (V, C) token embeddings
    pos: np.ndarray         # (max_ctx, C) learned positions
    layers: tuple           # per layer: dict of Wq, Wk, Wv, Wo (C, C), W1 (C, ff), W2 (ff, C)
    head: np.ndarray        # (C, V) output projection


def init_model(cfg: Config = Config()) -> Model:
    """Random weights from a fixed seed. Untrained: this is about compute, not language."""
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
    rng = np.random.default_rng(cfg.seed)
    C, ff = cfg.d_model, cfg.d_ff

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return rng.standard_normal((n_in, n_out)) / math.sqrt(n_in)   # unit-variance outputs

    layers = tuple(
        {"Wq": dense(C, C), "Wk": dense(C, C), "Wv": dense(C, C), "Wo": dense(C, C),
         "W1": dense(C, ff), "W2": dense(ff, C)}
        for _ in range(cfg.n_layers)
    )
    return Model(cfg=cfg,
                 emb=rng.standard_normal((cfg.vocab_size, C)),
                 pos=rng.standard_normal((cfg.max_ctx, C)),
                 layers=layers,
                 # A larger spread than 1/sqrt(C) so greedy decoding does not
                 # collapse onto one token: a loop that never varies proves nothing.
                 head=rng.standard_normal((C, cfg.vocab_size)) * 2 / math.sqrt(C))


def layernorm(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(axis=-1, keepdims=True) + eps)


def softmax(x: np.ndarray) -> np.ndarray:
    # exp(-inf - max) = 0: a masked column adds exactly nothing to its row's sum.
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    T, C = x.shape
    return x.reshape(T, n_heads, C // n_heads).transpose(1, 0, 2)   # (nh, T, hs)


def merge_heads(x: np.ndarray) -> np.ndarray:
    nh, T, hs = x.shape
    return x.transpose(1, 0, 2).reshape(T, nh * hs)                   # (T, C)


def new_cache(cfg: Config, with_q: bool = False) -> list[dict[str, np.ndarray]]:
    """Per layer: K and V, each (nh, tokens so far, hs). Never Q (only the cache-q break asks)."""
    names = ("K", "V", "Q") if with_q else ("K", "V")
    return [{name: np.zeros((cfg.n_heads, 0, cfg.head_dim)) for name in names}
            for _ in range(cfg.n_layers)]


def cache_len(cache: list[dict[str, np.ndarray]]) -> int:
    return cache[0]["K"].shape[1]


def forward(model: Model, ids: list[int], start_pos: int = 0, cache: list | None = None,
            use_mask: bool = True, append: bool = True, attn_out: list | None = None) -> np.ndarray:
    """Run `ids` (at positions start_pos, start_pos+1, ...) through every layer.

    Without a cache this is the full forward over a prefix. With one, the new
    tokens' K and V are appended (unless `append` is off: the no-append break)
    and the queries attend over everything cached. If `attn_out` is a list, each
    layer's attention weights (nh, T, keys) are appended to it. Returns (T, V) logits.
    """
    cfg = model.cfg
    T = len(ids)
    last = start_pos + T - 1
    if last >= cfg.max_ctx:
        raise IndexError(f"position {last} past context window {cfg.max_ctx}")
    x = model.emb[ids] + model.pos[start_pos:start_pos + T]           # (T, C)
    for i, L in enumerate(model.layers):
        h = layernorm(x)
        q = split_heads(h @ L["Wq"], cfg.n_heads)                     # (nh, T, hs), used once
        k = split_heads(h @ L["Wk"], cfg.n_heads)                     # (nh, T, hs), kept
        v = split_heads(h @ L["Wv"], cfg.n_heads)                     # (nh, T, hs), kept
        if cache is not None:
            c = cache[i]
            if "Q" in c:   # the cache-q break: stored, and never read again
                c["Q"] = np.concatenate([c["Q"], q], axis=1)
            if append:
                # np.concatenate copies the whole cache: simple, and quadratic
                # in bytes over a generation. A real stack writes in place.
                c["K"] = np.concatenate([c["K"], k], axis=1)          # (nh, past + T, hs)
                c["V"] = np.concatenate([c["V"], v], axis=1)
            k, v = c["K"], c["V"]
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(cfg.head_dim)   # (nh, T, keys)
        if use_mask and T > 1:
            # With `past` keys already cached, query row r may read keys 0..past + r.
            # A one-token decode step needs no mask: every cached key is in the past.
            keys = k.shape[1]
            mask = np.tril(np.ones((T, keys), dtype=bool), k=keys - T)
            scores = np.where(mask, scores, -np.inf)
        weights = softmax(scores)
        if attn_out is not None:
            attn_out.append(weights)
        x = x + merge_heads(weights @ v) @ L["Wo"]
        h = layernorm(x)
        x = x + np.maximum(h @ L["W1"], 0) @ L["W2"]                 # ReLU feed-forward
    return layernorm(x) @ model.head                                  # (T, V)


def forward_full(model: Model, ids: list[int], use_mask: bool = True,
                 attn_out: list | None = None) -> np.ndarray:
    """The whole prefix from scratch, no cache: (T, V) logits."""
    return forward(model, ids, use_mask=use_mask, attn_out=attn_out)


def decode_step(model: Model, token: int, pos: int, cache: list, append: bool = True) -> np.ndarray:
    """One token in at position `pos`, one row of (V,) logits out; the cache grows by one row."""
    return forward(model, [token], start_pos=pos, cache=cache, append=append)[0]


# ----------------------------------------------------------------------------
# The two loops
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]     # the generated tokens, prompt excluded
    logits: np.ndarray          # (n_new, V): the row each token was chosen from


def generate_naive(model: Model, prompt: list[int], n_new: int,
                   use_mask: bool = True) -> Generation:
    """Every step re-runs the whole sequence so far and keeps only the last row."""
    ids, rows = list(prompt), []
    for _ in range(n_new):
        row = forward_full(model, ids, use_mask=use_mask)[-1]
        rows.append(row)
        ids.append(int(np.argmax(row)))
    return Generation(tuple(ids[len(prompt):]), np.array(rows))


def generate_cached(model: Model, prompt: list[int], n_new: int, append: bool = True,
                    cache: list | None = None, use_mask: bool = True) -> Generation:
    """Prefill the prompt into the cache, then one token per step.

    A cache passed in is used as it is, and positions continue after it: the
    wrong-cache break hands in another sequence's. `append=False` stops decode
    steps from adding their K and V: the no-append break.
    """
    cache = new_cache(model.cfg) if cache is None else cache
    pos = cache_len(cache)
    row = forward(model, prompt, start_pos=pos, cache=cache, use_mask=use_mask)[-1]   # prefill
    pos += len(prompt)
    tokens, rows = [], []
    for step in range(n_new):
        token = int(np.argmax(row))
        tokens.append(token)
        rows.append(row)
        if step + 1 < n_new:
            row = decode_step(model, token, pos, cache, append=append)
            pos += 1
    return Generation(tuple(tokens), np.array(rows))


# ----------------------------------------------------------------------------
# Counting: multiply-accumulates and bytes
# ----------------------------------------------------------------------------


def macs_per_token(n_layers: int, d_model: int, d_ff: int, n_ctx: int) -> int:
    """One token through every layer, attending over n_ctx keys.

    4·d·d for the Q, K, V, O projections, 2·d·n for the scores and the weighted
    sum over n keys, 2·d·ff for the feed-forward.
    """
    d = d_model
    return n_layers * (4 * d * d + 2 * d * n_ctx + 2 * d * d_ff)


def macs_cached_step(cfg: Config, n_ctx: int) -> int:
    """A cached step: one new token, attending over n_ctx cached keys."""
    return macs_per_token(cfg.n_layers, cfg.d_model, cfg.d_ff, n_ctx)


def macs_naive_step(cfg: Config, n_ctx: int) -> int:
    """A naive step: all n_ctx tokens from scratch, each counted at the full context.

    (A causal implementation could skip the masked half of the scores; the
    naive loop as usually written computes them, so this counts them.)
    """
    return n_ctx * macs_per_token(cfg.n_layers, cfg.d_model, cfg.d_ff, n_ctx)


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, seq_len: int,
                   dtype_bytes: int = 2, batch: int = 1) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × seq_len × dtype_bytes × batch."""
    return 2 * layers * kv_heads * head_dim * seq_len * dtype_bytes * batch


GIB = 2**30   # GiB means 2^30 bytes; GB would be 10^9

# Llama-2-7B's published shape, the running example of the memory demos.
LLAMA2_7B = {"layers": 32, "heads": 32, "head_dim": 128, "d_model": 4096,
             "params": 6_738_415_616, "dtype_bytes": 2}


# ----------------------------------------------------------------------------
# Demos: each returns a frozen dataclass, nothing printed
# ----------------------------------------------------------------------------

PROMPT = [3, 17, 42, 8]


@dataclass(frozen=True)
class MacsDemo:
    n_layers: int
    n_heads: int
    d_model: int
    seq: int
    naive_total: int
    cached_total: int
    ratio: float
    rows: tuple[tuple[int, int, int], ...]   # (step, naive MACs, cached MACs)


def demo_macs(cfg: Config = Config(), seq: int = 64,
              steps: tuple[int, ...] = (1, 8, 16, 32, 48, 64)) -> MacsDemo:
    naive = [macs_naive_step(cfg, n) for n in range(1, seq + 1)]
    cached = [macs_cached_step(cfg, n) for n in range(1, seq + 1)]
    return MacsDemo(cfg.n_layers, cfg.n_heads, cfg.d_model, seq, sum(naive), sum(cached),
                    sum(naive) / sum(cached),
                    tuple((s, naive[s - 1], cached[s - 1]) for s in steps if s <= seq))


@dataclass(frozen=True)
class ExactDemo:
    prompt: tuple[int, ...]
    naive_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    same_tokens: bool
    max_logit_diff: float
    distinct_tokens: int


def demo_exact(model: Model, n_new: int = 16) -> ExactDemo:
    naive = generate_naive(model, PROMPT, n_new)
    cached = generate_cached(model, PROMPT, n_new)
    return ExactDemo(tuple(PROMPT), naive.tokens, cached.tokens, naive.tokens == cached.tokens,
                     float(np.abs(naive.logits - cached.logits).max()), len(set(naive.tokens)))


@dataclass(frozen=True)
class MaskCase:
    use_mask: bool
    before: np.ndarray            # (4, 4) layer 0, head 0 weights over the first 4 tokens
    after: np.ndarray             # (4, 5) the same rows once a 5th token is appended
    max_change: float             # largest change in those rows (the 5th column counts)


@dataclass(frozen=True)
class MaskDemo:
    masked: MaskCase
    unmasked: MaskCase
    unmasked_cache_logit_diff: float   # cached vs recomputed logits for token 5, no mask
    argmax_recomputed: int
    argmax_cached: int


def _head0_rows(model: Model, ids: list[int], use_mask: bool) -> np.ndarray:
    attn: list[np.ndarray] = []
    forward_full(model, ids, use_mask=use_mask, attn_out=attn)
    return attn[0][0]              # layer 0, head 0: (T, T)


def _mask_case(model: Model, ids: list[int], use_mask: bool) -> MaskCase:
    before = _head0_rows(model, ids[:4], use_mask)
    after = _head0_rows(model, ids[:5], use_mask)[:4]
    # The 5th column was implicitly 0 before: count any weight it takes as change.
    change = max(float(np.abs(after[:, :4] - before).max()), float(after[:, 4].max()))
    return MaskCase(use_mask, before, after, change)


def _unmasked_cache_drift(model: Model, ids: list[int]) -> tuple[float, int, int]:
    """Token 5's logits from a cache filled without the mask, against a full recompute.

    Without the mask the first 4 tokens' layer-1 keys and values depend on
    later tokens, so the cached ones go stale the moment token 5 arrives.
    """
    cache = new_cache(model.cfg)
    forward(model, ids[:-1], cache=cache, use_mask=False)
    cached = decode_step(model, ids[-1], len(ids) - 1, cache)
    recomputed = forward_full(model, ids, use_mask=False)[-1]
    return (float(np.abs(cached - recomputed).max()),
            int(np.argmax(recomputed)), int(np.argmax(cached)))


def demo_mask(model: Model) -> MaskDemo:
    ids = PROMPT + [int(np.argmax(forward_full(model, PROMPT)[-1]))]   # the greedy 5th token
    drift, arg_full, arg_cached = _unmasked_cache_drift(model, ids)
    return MaskDemo(_mask_case(model, ids, True), _mask_case(model, ids, False),
                    drift, arg_full, arg_cached)


@dataclass(frozen=True)
class MemoryDemo:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    params: int
    weights_gib: float
    bytes_per_token: int
    batch: int
    rows: tuple[tuple[int, float, float, float], ...]   # (seq, GiB b1, GiB b32, b32 / weights)


def demo_memory(seqs: tuple[int, ...] = (1024, 4096, 32768, 131072), batch: int = 32) -> MemoryDemo:
    m = LLAMA2_7B
    weights_gib = m["params"] * m["dtype_bytes"] / GIB

    def gib(seq: int, b: int) -> float:
        return kv_cache_bytes(m["layers"], m["heads"], m["head_dim"], seq, m["dtype_bytes"],
                              b) / GIB

    return MemoryDemo(m["layers"], m["heads"], m["head_dim"], m["dtype_bytes"], m["params"],
                      weights_gib,
                      kv_cache_bytes(m["layers"], m["heads"], m["head_dim"], 1, m["dtype_bytes"]),
                      batch,
                      tuple((s, gib(s, 1), gib(s, batch), gib(s, batch) / weights_gib)
                            for s in seqs))


@dataclass(frozen=True)
class GqaRow:
    variant: str
    kv_heads: int
    gib_4k_b32: float
    gib_32k_b32: float
    bytes_per_token: int
    reduction: float            # n_heads / kv_heads


@dataclass(frozen=True)
class GqaDemo:
    n_heads: int
    rows: tuple[GqaRow, ...]


def demo_gqa() -> GqaDemo:
    m = LLAMA2_7B
    variants = (("multi-head", 32), ("GQA-8", 8), ("MQA", 1))

    def size(kv: int, seq: int, batch: int) -> int:
        return kv_cache_bytes(m["layers"], kv, m["head_dim"], seq, m["dtype_bytes"], batch)

    return GqaDemo(m["heads"], tuple(
        GqaRow(name, kv, size(kv, 4096, 32) / GIB, size(kv, 32768, 32) / GIB, size(kv, 1, 1),
               m["heads"] / kv)
        for name, kv in variants))


@dataclass(frozen=True)
class IntensityDemo:
    prompt_len: int
    prefill_macs: int
    decode_total_macs: int
    decode_step_macs: int          # one step at context prompt_len
    weight_bytes: int
    kv_bytes: int                  # the cache at prompt_len tokens
    prefill_macs_per_byte: float   # weights and cache read once for the whole prompt
    decode_macs_per_byte: float    # weights and cache read again for every single token


def demo_intensity(prompt_len: int = 512) -> IntensityDemo:
    m = LLAMA2_7B
    L, T, d = m["layers"], prompt_len, m["d_model"]
    ff = 4 * d                                      # d_ff = 4·d, the article's approximation

    def step(n: int) -> int:
        return macs_per_token(L, d, ff, n)

    # Prefill counted as one batched pass: every projection and FFN for T tokens
    # at once, and causal attention over T(T+1)/2 (query, key) pairs.
    prefill = L * (T * (4 * d * d + 2 * d * ff) + 2 * d * (T * (T + 1) // 2))
    # Decode counted step by step: step n attends over n keys. Same total.
    decode_total = sum(step(n) for n in range(1, T + 1))
    weight_bytes = m["params"] * m["dtype_bytes"]
    kv = kv_cache_bytes(L, m["heads"], m["head_dim"], T, m["dtype_bytes"])
    moved = weight_bytes + kv
    return IntensityDemo(T, prefill, decode_total, step(T), weight_bytes, kv,
                         prefill / moved, step(T) / moved)


# --- Paged storage --------------------------------------------------------


class PageAllocator:
    """A pool of fixed-size KV pages with reference counts, like vLLM's block manager.

    Pages hold `page_size` tokens of every layer's K and V. A page shared by
    several sequences (a common prompt prefix) is freed when the last one lets go.
    """

    def __init__(self, n_pages: int, page_size: int):
        self.page_size = page_size
        self.refcount = [0] * n_pages
        self.free_pages = list(range(n_pages - 1, -1, -1))   # pop() hands out page 0 first

    def alloc(self) -> int:
        if not self.free_pages:
            raise MemoryError(f"all {len(self.refcount)} KV pages are in use")
        page = self.free_pages.pop()
        self.refcount[page] = 1
        return page

    def share(self, page: int) -> int:
        self.refcount[page] += 1
        return page

    def release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self.free_pages.append(page)

    @property
    def pages_in_use(self) -> int:
        return len(self.refcount) - len(self.free_pages)


class PagedSequence:
    """One request's block table: logical page i of the sequence lives in pages[i]."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.pages: list[int] = []
        self.length = 0

    def fork_prefix(self, parent: PagedSequence, n_tokens: int) -> None:
        """Share the parent's pages that hold only prefix tokens; the rest is appended."""
        full = n_tokens // self.allocator.page_size
        self.pages = [self.allocator.share(p) for p in parent.pages[:full]]
        self.length = full * self.allocator.page_size

    def append(self, n_tokens: int = 1) -> None:
        """Grow by n_tokens, allocating a page only when the last one is full."""
        self.length += n_tokens
        while len(self.pages) * self.allocator.page_size < self.length:
            self.pages.append(self.allocator.alloc())

    def free(self) -> None:
        for page in self.pages:
            self.allocator.release(page)
        self.pages, self.length = [], 0


@dataclass(frozen=True)
class PagedDemo:
    n_requests: int
    page_size: int
    max_len: int                   # what a contiguous allocator reserves per request
    shared_prefix: int             # system-prompt tokens every request starts with
    tokens_held: int               # tokens across all requests at full length
    tokens_stored: int             # the same with the shared prefix pages stored once
    contiguous_reserved: int       # tokens reserved by max-length slabs
    contiguous_utilisation: float
    paged_pages: int               # pages in use, no sharing
    paged_utilisation: float
    shared_pages: int              # pages in use with the prefix shared
    pages_saved_by_sharing: int
    shared_utilisation: float
    pages_free_after: int          # every page back in the pool once all requests finish
    n_pages: int
    bytes_per_token: int           # Llama-2-7B shape, to turn tokens into GiB
    example_request: int
    example_length: int
    example_block_table: tuple[int, ...]
    lengths: tuple[int, ...]


def _paged_run(prompts: list[int], replies: list[int], n_pages: int, page_size: int,
               shared_prefix: int) -> tuple[int, list[int], int]:
    """Admit every request, decode all to full length in lockstep, then finish them.

    Returns (pages in use at full length, request 1's block table, free pages after).
    With shared_prefix > 0, requests after the first share its prefix pages.
    """
    allocator = PageAllocator(n_pages, page_size)
    seqs: list[PagedSequence] = []
    for prompt in prompts:
        seq = PagedSequence(allocator)
        if shared_prefix and seqs:
            seq.fork_prefix(seqs[0], shared_prefix)
        seq.append(prompt - seq.length)          # prefill: the (unshared) prompt at once
        seqs.append(seq)
    # One token per running request per step, so the requests' pages interleave
    # in the pool as they do in a server: a block table is not contiguous.
    for step in range(max(replies)):
        for seq, reply in zip(seqs, replies):
            if step < reply:
                seq.append()
    in_use = allocator.pages_in_use
    table = list(seqs[1].pages)
    for seq in seqs:
        seq.free()
    return in_use, table, len(allocator.free_pages)


def demo_paged(n_requests: int = 32, page_size: int = 16, max_len: int = 2048,
               shared_prefix: int = 200, seed: int = 0) -> PagedDemo:
    rng = np.random.default_rng(seed)
    # Prompts: a shared system prompt plus a user turn; replies mostly short,
    # sometimes long (exponential), capped by the serving limit.
    user = rng.integers(16, 256, n_requests)
    reply = np.minimum(rng.exponential(300, n_requests).astype(int) + 8,
                       max_len - shared_prefix - user)
    prompts = [int(shared_prefix + u) for u in user]
    replies = [int(r) for r in reply]
    lengths = [p + r for p, r in zip(prompts, replies)]
    n_pages = n_requests * max_len // page_size      # the same memory the slabs would take
    held = sum(lengths)
    # Only whole pages of the prefix are shared; its tail page is each request's own.
    stored = held - (n_requests - 1) * (shared_prefix // page_size) * page_size
    paged, _, _ = _paged_run(prompts, replies, n_pages, page_size, 0)
    shared, table, free_after = _paged_run(prompts, replies, n_pages, page_size, shared_prefix)
    return PagedDemo(
        n_requests, page_size, max_len, shared_prefix, held, stored, n_requests * max_len,
        held / (n_requests * max_len), paged, held / (paged * page_size), shared, paged - shared,
        stored / (shared * page_size), free_after, n_pages,
        kv_cache_bytes(LLAMA2_7B["layers"], LLAMA2_7B["heads"], LLAMA2_7B["head_dim"], 1),
        1, lengths[1], tuple(table), tuple(lengths))


# ----------------------------------------------------------------------------
# Breaks: each removes one piece and measures the symptom
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NoMaskBreak:
    earlier_rows_change: float         # layer 0 head 0, first 4 rows, once a 5th token arrives
    max_logit_diff: float              # cached vs recomputed, over a whole generation
    steps: int
    argmax_flips: int                  # steps where the cached loop picks another token
    recomputed_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]


def break_no_mask(model: Model, n_new: int = 8) -> NoMaskBreak:
    """A bidirectional model generates with a cache: the cached K and V go stale.

    Both loops feed the same tokens (the recomputed loop's), so every difference
    is the stale cache, not an earlier divergence.
    """
    truth = generate_naive(model, PROMPT, n_new, use_mask=False)
    ids = PROMPT + list(truth.tokens)
    cache = new_cache(model.cfg)
    rows = [forward(model, PROMPT, cache=cache, use_mask=False)[-1]]
    for step, token in enumerate(truth.tokens[:-1]):
        rows.append(decode_step(model, token, len(PROMPT) + step, cache))
    cached = np.array(rows)
    picks = tuple(int(t) for t in cached.argmax(axis=-1))
    return NoMaskBreak(_mask_case(model, ids, False).max_change,
                       float(np.abs(cached - truth.logits).max()), n_new,
                       sum(a != b for a, b in zip(picks, truth.tokens)), truth.tokens, picks)


@dataclass(frozen=True)
class NoAppendBreak:
    correct_tokens: tuple[int, ...]
    broken_tokens: tuple[int, ...]
    correct_distinct: int
    broken_distinct: int
    cache_len_correct: int
    cache_len_broken: int


def break_no_append(model: Model, n_new: int = 16) -> NoAppendBreak:
    good_cache, bad_cache = new_cache(model.cfg), new_cache(model.cfg)
    good = generate_cached(model, PROMPT, n_new, cache=good_cache)
    bad = generate_cached(model, PROMPT, n_new, append=False, cache=bad_cache)
    return NoAppendBreak(good.tokens, bad.tokens, len(set(good.tokens)), len(set(bad.tokens)),
                         cache_len(good_cache), cache_len(bad_cache))


@dataclass(frozen=True)
class CacheQBreak:
    q_norms: tuple[float, ...]         # ||q||, layer 0, every head, one per position
    q_reads: tuple[int, ...]           # times each position's q is read: once
    k_reads: tuple[int, ...]           # times each position's k is read: by every later step
    same_tokens: bool                  # caching Q changes nothing but the bytes held
    bytes_kv: int
    bytes_kv_and_q: int


def break_cache_q(model: Model, n_new: int = 8) -> CacheQBreak:
    cache = new_cache(model.cfg, with_q=True)
    with_q = generate_cached(model, PROMPT, n_new, cache=cache)
    plain = generate_cached(model, PROMPT, n_new)
    q = cache[0]["Q"]                                                  # (nh, T, hs)
    T = q.shape[1]
    # Position j's key is read by the query at j and by every one after it.
    return CacheQBreak(tuple(float(x) for x in np.linalg.norm(q, axis=(0, 2))),
                       (1,) * T, tuple(T - j for j in range(T)), with_q.tokens == plain.tokens,
                       sum(c["K"].nbytes + c["V"].nbytes for c in cache),
                       sum(c["K"].nbytes + c["V"].nbytes + c["Q"].nbytes for c in cache))


@dataclass(frozen=True)
class OverflowBreak:
    window: int
    prompt_len: int
    tokens_before_error: int
    error: str
    position: int
    wraps_to: int                      # the row a wrapping position table would silently reuse


def break_overflow(model: Model) -> OverflowBreak:
    cfg = model.cfg
    cache = new_cache(cfg)
    row = forward(model, PROMPT, cache=cache)[-1]
    pos, made = len(PROMPT), 0
    try:
        while True:   # no eviction, no stopping rule: generate until something gives
            row = decode_step(model, int(np.argmax(row)), pos, cache)
            pos, made = pos + 1, made + 1
    except IndexError as err:
        return OverflowBreak(cfg.max_ctx, len(PROMPT), made + 1, str(err), pos,
                             pos % cfg.max_ctx)


@dataclass(frozen=True)
class WrongCacheBreak:
    prompt_a: tuple[int, ...]
    prompt_b: tuple[int, ...]
    own_tokens: tuple[int, ...]        # A on a fresh cache
    leaked_tokens: tuple[int, ...]     # A on B's warm cache
    first_divergence: int | None       # first step where they differ
    foreign_tokens_attended: int       # B's tokens A's queries read


def break_wrong_cache(model: Model, n_new: int = 8) -> WrongCacheBreak:
    prompt_b = [50, 9, 33, 21, 60, 5]
    warm = new_cache(model.cfg)
    generate_cached(model, prompt_b, n_new, cache=warm)
    foreign = cache_len(warm)
    own = generate_cached(model, PROMPT, n_new)
    leaked = generate_cached(model, PROMPT, n_new, cache=warm)
    diverge = next((i for i, (a, b) in enumerate(zip(own.tokens, leaked.tokens)) if a != b), None)
    return WrongCacheBreak(tuple(PROMPT), tuple(prompt_b), own.tokens, leaked.tokens, diverge,
                           foreign)


# ----------------------------------------------------------------------------
# Plain-text views
# ----------------------------------------------------------------------------


def _grid(m: np.ndarray, indent: str = "      ") -> list[str]:
    return [indent + np.array2string(row, precision=3, suppress_small=True, floatmode="fixed")
            for row in m]


def text_macs(r: MacsDemo) -> list[str]:
    lines = [f"toy model: {r.n_layers} layers, {r.n_heads} heads, d_model={r.d_model}, seq={r.seq}",
             "",
             f"  naive  loop total MACs: {r.naive_total:>12,}",
             f"  cached loop total MACs: {r.cached_total:>12,}",
             f"  ratio                 : {r.ratio:>11.1f}x",
             "",
             "  per-step cost (MACs): naive grows with the context, cached stays nearly flat",
             f"    {'step':>4} | {'naive':>12} | {'cached':>10}"]
    lines += [f"    {s:>4} | {n:>12,} | {c:>10,}" for s, n, c in r.rows]
    return lines


def text_exact(r: ExactDemo) -> list[str]:
    return [f"  prompt        : {list(r.prompt)}",
            f"  naive  tokens : {list(r.naive_tokens)}",
            f"  cached tokens : {list(r.cached_tokens)}",
            f"  same token sequence? {r.same_tokens}  ({r.distinct_tokens} distinct tokens)",
            f"  max |naive logits - cached logits| = {r.max_logit_diff:.3e}"
            + ("  (float64 noise)" if r.max_logit_diff <= 1e-12 else "  (NOT exact)")]


def text_mask(r: MaskDemo) -> list[str]:
    lines = []
    for case in (r.masked, r.unmasked):
        lines += [f"  {'WITH causal mask' if case.use_mask else 'NO mask'}"
                  " -- layer 0, head 0 attention weights",
                  "    before appending a 5th token (4x4):", *_grid(case.before),
                  "    after appending a 5th token, first 4 rows (4x5):", *_grid(case.after),
                  f"    max change in the first 4 rows: {case.max_change:.3e}", ""]
    lines += ["  the consequence for a cache, no mask:",
              f"    cached vs recomputed logits, max abs diff: {r.unmasked_cache_logit_diff:.4f}",
              f"    argmax token: recomputed={r.argmax_recomputed}  cached={r.argmax_cached}"]
    return lines


def text_memory(r: MemoryDemo) -> list[str]:
    lines = [f"  Llama-2-7B shape: {r.layers} layers, {r.kv_heads} KV heads, head_dim {r.head_dim},"
             f" {8 * r.dtype_bytes}-bit",
             "  bytes = 2 * layers * kv_heads * head_dim * seq_len * dtype_bytes * batch",
             "",
             f"  weights ({r.params:,} params):  {r.weights_gib:.2f} GiB",
             f"  cache per token: {r.bytes_per_token:,} bytes = {r.bytes_per_token // 1024} KiB",
             "",
             f"  {'seq_len':>9} | {'batch 1':>10} | {f'batch {r.batch}':>11} | vs weights"]
    lines += [f"  {s:>9,} | {b1:>6.2f} GiB | {bn:>7.1f} GiB | {x:>6.1f}x"
              for s, b1, bn, x in r.rows]
    return lines


def text_gqa(r: GqaDemo) -> list[str]:
    lines = [f"  {'variant':<12} {'kv_heads':>8} | {'4k, b32':>10} | {'32k, b32':>10} |"
             f" {'bytes/token':>11} | reduction"]
    lines += [f"  {g.variant:<12} {g.kv_heads:>8} | {g.gib_4k_b32:>6.1f} GiB | "
              f"{g.gib_32k_b32:>6.1f} GiB | {g.bytes_per_token:>11,} | {g.reduction:>6.0f}x"
              for g in r.rows]
    return lines + [f"  reduction = n_heads / kv_heads (n_heads = {r.n_heads}); Q is never cached"]


def text_intensity(r: IntensityDemo) -> list[str]:
    return [f"  Llama-2-7B shape, d_ff = 4*d_model, {r.prompt_len}-token prompt:",
            f"    prefill, one batched pass  : {r.prefill_macs:>19,} MACs, weights read once",
            f"    {r.prompt_len} sequential decode steps: {r.decode_total_macs:>19,} MACs,"
            f" weights read {r.prompt_len}x",
            f"    one decode step            : {r.decode_step_macs:>19,} MACs",
            f"  bytes moved: {r.weight_bytes:,} of fp16 weights + {r.kv_bytes:,} of cache",
            "  arithmetic intensity (MACs per byte moved):",
            f"    prefill : {r.prefill_macs_per_byte:>8.1f}",
            f"    decode  : {r.decode_macs_per_byte:>8.2f}"]


def text_paged(r: PagedDemo) -> list[str]:
    def gib(tokens: int) -> float:
        return tokens * r.bytes_per_token / GIB

    schemes = (
        (f"contiguous, {r.max_len:,} per request", f"{r.contiguous_reserved:,} tokens",
         gib(r.contiguous_reserved), r.contiguous_utilisation),
        (f"paged, {r.page_size}-token pages", f"{r.paged_pages:,} pages",
         gib(r.paged_pages * r.page_size), r.paged_utilisation),
        ("paged + shared prefix", f"{r.shared_pages:,} pages",
         gib(r.shared_pages * r.page_size), r.shared_utilisation),
    )
    return [f"  {r.n_requests} requests, each a {r.shared_prefix}-token shared system prompt, a"
            f" user turn and a reply of seeded random length",
            f"  {r.tokens_held:,} tokens in all ({r.tokens_stored:,} with the prefix stored once);"
            f" Llama-2-7B shape, {r.bytes_per_token // 1024} KiB per token",
            "",
            f"    {'scheme':<30} {'reserved':>13} {'GiB':>7}  holds tokens",
            *(f"    {name:<30} {reserved:>13} {g:>7.1f}  {util:>11.1%}"
              for name, reserved, g, util in schemes),
            "",
            f"  sharing the prefix saves {r.pages_saved_by_sharing} pages"
            f" ({gib(r.pages_saved_by_sharing * r.page_size):.1f} GiB); once every request"
            f" finishes, {r.pages_free_after:,} of {r.n_pages:,} pages are free again",
            f"  request {r.example_request}'s block table ({r.example_length} tokens;"
            " logical page i lives in physical page table[i]):",
            "    " + " ".join(str(p) for p in r.example_block_table)]


def text_no_mask(r: NoMaskBreak) -> list[str]:
    return [f"  earlier attention rows move by {r.earlier_rows_change:.3e} when a token arrives",
            f"  cached vs recomputed logits over {r.steps} steps, max abs diff:"
            f" {r.max_logit_diff:.4f}",
            f"  argmax differs at {r.argmax_flips} of {r.steps} steps",
            f"    recomputed: {list(r.recomputed_tokens)}",
            f"    cached    : {list(r.cached_tokens)}"]


def text_no_append(r: NoAppendBreak) -> list[str]:
    return [f"  correct  : {list(r.correct_tokens)}  ({r.correct_distinct} distinct,"
            f" cache ends at {r.cache_len_correct} tokens)",
            f"  no-append: {list(r.broken_tokens)}  ({r.broken_distinct} distinct,"
            f" cache stuck at {r.cache_len_broken} tokens: the prompt)",
            "  the model never sees what it just wrote"]


def text_cache_q(r: CacheQBreak) -> list[str]:
    return ["  ||q|| per position (layer 0): " + ", ".join(f"{n:.3f}" for n in r.q_norms),
            f"  times each cached q is read : {list(r.q_reads)}",
            f"  times each cached k is read : {list(r.k_reads)}",
            f"  same tokens with Q cached? {r.same_tokens}; bytes held {r.bytes_kv:,}"
            f" -> {r.bytes_kv_and_q:,} for nothing"]


def text_overflow(r: OverflowBreak) -> list[str]:
    return [f"  prompt of {r.prompt_len}, window {r.window}: {r.tokens_before_error} tokens,"
            " then:",
            f"    IndexError: {r.error}",
            f"  a wrapping position table would silently reuse row {r.wraps_to}"
            f" for position {r.position}: no error, just garbage"]


def text_wrong_cache(r: WrongCacheBreak) -> list[str]:
    where = "never" if r.first_divergence is None else f"from step {r.first_divergence}"
    return [f"  prompt A {list(r.prompt_a)}, B's warm cache holds {r.foreign_tokens_attended}"
            f" tokens of prompt {list(r.prompt_b)} and its reply",
            f"    A on its own cache: {list(r.own_tokens)}",
            f"    A on B's cache    : {list(r.leaked_tokens)}",
            f"  outputs differ {where}: A is reading another user's tokens"]


# ----------------------------------------------------------------------------
# The registry and main()
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[[Model], object]
    text: Callable[[object], list[str]]


DEMOS = {s.name: s for s in (
    Scenario("macs", "1. Two loops, and a 34x gap", lambda m: demo_macs(m.cfg), text_macs),
    Scenario("exact", "2. Same tokens, to float precision", demo_exact, text_exact),
    Scenario("mask", "3. The mask is the proof", demo_mask, text_mask),
    Scenario("memory", "4. The cache outgrows the model", lambda m: demo_memory(), text_memory),
    Scenario("gqa", "5. MQA and GQA: shrink one term", lambda m: demo_gqa(), text_gqa),
    Scenario("intensity", "6. Prefill is compute-bound, decode is memory-bound",
             lambda m: demo_intensity(), text_intensity),
    Scenario("paged", "7. PagedAttention: pages, not slabs", lambda m: demo_paged(), text_paged),
)}

BREAKS = {s.name: s for s in (
    Scenario("no-mask", "Break 1: no causal mask", break_no_mask, text_no_mask),
    Scenario("no-append", "Break 2: never append K and V", break_no_append, text_no_append),
    Scenario("cache-q", "Break 3: cache Q too", break_cache_q, text_cache_q),
    Scenario("overflow", "Break 4: past the context window", break_overflow, text_overflow),
    Scenario("wrong-cache", "Break 5: another sequence's cache", break_wrong_cache,
             text_wrong_cache),
)}


def render(scenario: Scenario, model: Model) -> str:
    bar = "=" * 78
    return "\n".join([bar, scenario.title, bar, *scenario.text(scenario.run(model)), ""])


class OneLineParser(argparse.ArgumentParser):
    """A bad argument in one line, as the CLI reports it, not argparse's usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", metavar="NAME", help="run one demo: " + ", ".join(DEMOS))
    parser.add_argument("--break", dest="break_", metavar="NAME",
                        help="run one break: " + ", ".join(BREAKS))
    parser.add_argument("--list", action="store_true", help="list the demos and breaks")
    args = parser.parse_args(argv)

    for chosen, table, kind in ((args.demo, DEMOS, "demo"), (args.break_, BREAKS, "break")):
        if chosen is not None and chosen not in table:
            print(f"error: unknown {kind} {chosen!r}; choose one of: {', '.join(table)}",
                  file=sys.stderr)
            return 2
    if args.list:
        for kind, table in (("demo", DEMOS), ("break", BREAKS)):
            for s in table.values():
                print(f"{kind:<6} {s.name:<12} {s.title}")
        return 0

    if args.demo or args.break_:
        chosen = [DEMOS[args.demo]] if args.demo else []
        chosen += [BREAKS[args.break_]] if args.break_ else []
    else:
        chosen = [*DEMOS.values(), *BREAKS.values()]
    model = init_model()
    print("\n".join(render(s, model) for s in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
