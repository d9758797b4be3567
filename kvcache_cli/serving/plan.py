"""A serving run's plan: which engines and variants, the KV memory each may use and how
many sequences it admits, the block size, the budgets of a sweep; checked before a model loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache_cli import numbers
from kvcache_cli.caches.paged import block_bytes
from kvcache_cli.caches.quantized_pool import POOLS
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec

ENGINES = ("sequential", "padded", "paged", "hf")

BLOCK_SIZE = 16  # vLLM's default block: a short sequence wastes at most 15 slots


@dataclass(frozen=True)
class Variant:
    """An engine, and for paged its scheduler policy and token budget."""

    engine: str
    policy: str | None = None  # paged only
    token_budget: int | None = None  # decode-first only
    # paged on a hybrid model: tokens between the sliding windows kept for later prefix
    # hits (`serving.hybrid_blocks`); 0 keeps none; None on a model of one layer kind
    keep: int | None = None

    @property
    def name(self) -> str:
        """`paged pf` (prefill-first), `paged df 256` (decode-first, 256 tokens a forward),
        `paged pf keep 64` (windows kept every 64 tokens): short enough for a table's first
        column beside seven figures."""
        if self.policy is None:
            return self.engine
        kept = f" keep {self.keep}" if self.keep else ""
        if self.policy == "prefill-first":
            return f"{self.engine} pf{kept}"
        return f"{self.engine} df {self.token_budget}{kept}"


def variants(engines: Sequence[str], policies: Sequence[str] = ("prefill-first",),
             budgets: Sequence[int] = (), keeps: Sequence[int | None] = (None,)
             ) -> tuple[Variant, ...]:
    """Every engine once; paged once per policy, decode-first once per budget, each once per
    window-keeping interval (a hybrid model's)."""
    out = []
    for engine in engines:
        if engine not in POOLS:  # the paged engine on any pool runs each policy
            out.append(Variant(engine))
            continue
        for policy in policies:
            for keep in keeps:
                if policy == "decode-first":
                    out += [Variant(engine, policy, b, keep) for b in budgets]
                else:
                    out.append(Variant(engine, policy, keep=keep))
    return tuple(out)


def parse_keeps(text: str | None, block_size: int, hybrid: bool) -> tuple[int | None, ...]:
    """`"0,64"` -> (0, 64): --keep-windows, each 0 or a multiple of the block size; (None,)
    without it on a model of one layer kind, (0,) on a hybrid one."""
    if text is None:
        return (0,) if hybrid else (None,)
    if not hybrid:
        raise ValueError("--keep-windows: this model has no sliding layers, so its pool "
                         "keeps every block; expected a model such as gemma3")
    parts = [part.strip() for part in text.split(",")]
    if not all(numbers.is_whole(part) for part in parts):
        raise ValueError(f"--keep-windows {text!r}: expected tokens, comma-separated, "
                         "e.g. 0,64")
    keeps = tuple(int(part) for part in parts)
    for k in keeps:
        if k % block_size:
            raise ValueError(f"--keep-windows {k:,}: expected 0 or a multiple of the block "
                             f"size ({block_size:,})")
    if len(set(keeps)) < len(keeps):
        raise ValueError(f"--keep-windows {text!r}: an interval given twice")
    return keeps


def parse_engines(text: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in ENGINES and n not in POOLS]
    if unknown or not names:
        what = f"unknown engine {', '.join(map(repr, unknown))}" if unknown else "no engines"
        raise ValueError(f"--engines: {what}; valid engines: {', '.join(ENGINES)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--engines {text!r}: an engine given twice")
    if "hf" in names:
        check_hf_engine()
    return names


# transformers' continuous batching refuses pages smaller than this (its BOUNDS["page_size"]),
# in its own words and only once its engine starts, after the others have run.
HF_MIN_PAGE = 4


def check_hf_block_size(engines: Sequence[str], block_size: int) -> None:
    """Refuse, before any engine runs, a --block-size the hf engine cannot page."""
    if "hf" in engines and block_size < HF_MIN_PAGE:
        raise ValueError(f"--block-size {block_size:,}: the hf engine (transformers' "
                         f"continuous batching) pages at least {HF_MIN_PAGE} tokens a block; "
                         f"expected {HF_MIN_PAGE} or more, or --engines without hf")


def parse_budgets(text: str, block_size: int) -> tuple[int, ...]:
    """`"64,256,1024"` -> (64, 256, 1024): decode-first's token budgets, each at least a block."""
    from kvcache_cli.serving.scheduler import check_budget

    parts = [part.strip() for part in text.split(",")]
    if not all(numbers.is_whole(part) for part in parts):
        raise ValueError(f"--token-budget {text!r}: expected tokens per forward, "
                         "comma-separated, e.g. 64,256,1024")
    budgets = tuple(int(part) for part in parts)
    for b in budgets:
        check_budget(b, block_size)
    if len(set(budgets)) < len(budgets):
        raise ValueError(f"--token-budget {text!r}: a budget given twice")
    return budgets


def check_hf_engine() -> None:
    """The hf engine drives transformers' continuous batching, which older releases lack."""
    try:
        from transformers.generation.configuration_utils import (  # noqa: F401
            ContinuousBatchingConfig,
        )
    except ImportError:
        import transformers

        raise ValueError(
            f"--engines hf: transformers {transformers.__version__} has no continuous batching "
            "(generate_batch): upgrade transformers, or leave hf out of --engines") from None


@dataclass(frozen=True)
class Plan:
    """How kv_mem is shared out: paged blocks, padded rows."""

    n_blocks: int
    padded_rows: int
    slab_len: int
    kv_mem: int = 0  # what a quantised pool's blocks are counted from


def plan_memory(config, dtype: torch.dtype, spec: WorkloadSpec, kv_mem: int, block_size: int,
                max_batch: int) -> Plan:
    """Refuse a budget that cannot hold even the longest request."""
    if block_size < 1:
        raise ValueError(f"--block-size {block_size}: expected at least 1 token")
    if max_batch < 1:
        raise ValueError(f"--max-batch {max_batch}: expected at least 1")
    per_token = block_bytes(config.cache_shape, 1, dtype)
    n_blocks = kv_mem // block_bytes(config.cache_shape, block_size, dtype)
    need = -(-spec.longest // block_size)
    if n_blocks < need:
        raise ValueError(
            f"--kv-mem {kv_mem:,} bytes holds {n_blocks} blocks of {block_size} tokens "
            f"({per_token:,} bytes a token); the longest request ({spec.longest} tokens) "
            f"needs {need}")
    rows = min(max_batch, kv_mem // (spec.longest * per_token))
    return Plan(n_blocks, rows, spec.longest, kv_mem)


def fit_padded(plan: Plan, requests: Sequence[Request], config, dtype: torch.dtype,
               kv_mem: int, max_batch: int) -> Plan:
    """The padded engine sized to the workload, as a batched generate() is sized to its batch:
    rows for no more requests than there are, each as long as the longest prompt there is
    plus the longest output (every row decodes until the group's longest is done), not as
    long as the ranges allow, within kv_mem. Reserving rows for the whole budget would
    charge it for memory no request asked for."""
    longest = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
    row_bytes = longest * block_bytes(config.cache_shape, 1, dtype)
    rows = min(max_batch, len(requests), kv_mem // row_bytes)
    return dataclasses.replace(plan, padded_rows=rows, slab_len=longest)


def warmup_request(longest: int) -> Request:
    """A short untimed request that fits wherever the workload's longest does."""
    prompt = max(1, min(8, longest - 1))
    return Request(-1, (0,) * prompt, max(1, min(4, longest - prompt)), 0.0)
