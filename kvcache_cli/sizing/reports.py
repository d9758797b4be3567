"""What sizing reports beyond the arithmetic: every cache kind's bytes held by a model
kvcache runs (`size -m smollm2`), and the bytes transformers' own cache holds, layer by
layer, against the prediction (`size --verify`); what a serving engine allocates and the
command that starts it so (`size --engine`, computed in `sizing.engines`). Data only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindHeld:
    spec: str  # the kind, as --cache spells it in full (int4:g32:kchan:r128)
    kv_heads: int
    bytes_held: int  # one sequence of `seq` tokens, every layer
    bytes_per_token: float  # bytes_held / seq
    ratio_to_static: float


@dataclass(frozen=True)
class LiveKinds:
    """What every cache kind holds for one sequence of a model kvcache runs."""

    model: str
    dtype: str  # what the caches keep at full precision
    seq: int
    kinds: tuple[KindHeld, ...]
    mha: KindHeld  # the static cache of the same model with a KV head per query head
    left_out: tuple[str, ...]


@dataclass(frozen=True)
class VerifyLayer:
    index: int  # the layer's index in the model that was built (not the original)
    kind: str
    key_shape: tuple[int, ...]  # as stored: (B, n_kv, T, hs)
    value_shape: tuple[int, ...]
    measured_bytes: int
    formula_bytes: int


@dataclass(frozen=True)
class Verification:
    """The bytes a real transformers cache holds beside the formula's, for the same layers."""

    model_type: str
    dtype: str
    tokens: int
    window: int | None  # the window used for the check (shrunk so the check stays fast)
    layers: tuple[VerifyLayer, ...]
    measured_bytes: int  # K/V (and indexer keys) in every layer
    formula_bytes: int
    state_measured_bytes: int  # recurrent states (conv + SSM) in every layer
    state_formula_bytes: int
    matches: bool  # K/V and states both exactly the formula's
    window_convention_only: bool  # every difference is transformers' window − 1 (see _explain)
    changes: tuple[str, ...]  # what was shrunk to build it fast; none of it changes the cache
    explanation: tuple[str, ...]


@dataclass(frozen=True)
class Flag:
    flag: str  # as typed: "--block-size 16", "VLLM_CPU_KVCACHE_SPACE=1"
    reason: str  # one line: why the fit asks for it


@dataclass(frozen=True)
class SpecGroup:
    """One of vLLM's KV cache groups: layers sharing a block table."""

    kind: str  # full, sliding, chunked, mla
    layers: int
    page_bytes: int  # one block of one layer
    blocks_per_request: int  # a request at max_model_len, from this group
    block_size: int  # tokens a block of this group (a sliding one's is the kernel's)


@dataclass(frozen=True)
class LlamaCppCache:
    """One of llama.cpp's KV caches (its non-SWA or its SWA one), as its log reports it."""

    kind: str  # full, sliding (chunked layers share llama.cpp's SWA cache)
    layers: int
    cells: int  # a stream's cells ("size = … (N cells, …)")
    streams: int  # one per sequence (-np) unless the cache is unified
    k_bytes: int  # every layer, every stream
    v_bytes: int
    log_line: str  # "llama_kv_cache: size = …", as llama_kv_cache logs it


@dataclass(frozen=True)
class FrontEnd:
    """llama.cpp as one front end starts it: the settings that size its caches."""

    name: str  # llama-server, llama-cpp-python
    launch: str  # the command line, or the Python constructor
    n_ctx: int  # as asked (llama.cpp pads it to 256 cells)
    n_seq: int  # sequences (slots)
    unified: bool  # one cache shared by the sequences (else a stream each)
    swa_full: bool  # the SWA cache as big as the full one
    n_ubatch: int  # after llama.cpp's min(n_ctx, n_batch, n_ubatch)
    caches: tuple[LlamaCppCache, ...]
    total_bytes: int


@dataclass(frozen=True)
class EngineFit:
    """What ENGINE makes of the memory for the KV cache, and how to start it so."""

    engine: str
    model: str  # what the command names
    kv_bytes: int  # memory the KV cache gets
    memory: str  # where kv_bytes came from, in words
    cache_dtype: str  # kvcache's name of what a value is stored as: fp32, fp16, fp8, ...
    bytes_per_token: int  # every layer, one token, one GPU
    max_model_len: int
    block_size: int | None  # vLLM's (and the block each llama.cpp slot rounds to: None)
    groups: tuple[SpecGroup, ...]  # vLLM's; () for the others
    bytes_per_block: int | None  # one block of the pool, every group's pages
    num_blocks: int | None
    tokens: int  # vLLM: "KV cache size"; SGLang: its token pool; llama.cpp: -c
    max_concurrency: float  # requests of max_model_len tokens at once
    fits: bool  # one request of max_model_len fits (else the engine refuses to start)
    log_line: str  # what the engine says at start-up, as it says it (vLLM's)
    command: str
    flags: tuple[Flag, ...]
    notes: tuple[str, ...]
    # llama.cpp: its caches as each front end allocates them (llama-server, llama-cpp-python)
    front_ends: tuple[FrontEnd, ...] = ()
