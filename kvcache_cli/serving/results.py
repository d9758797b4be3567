"""What a serving run returns: each engine's figures (latency percentiles, throughput,
bytes, steps), its replies and where they differ from one-at-a-time decoding, the whole run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_cli.serving.gqa_pool import PoolFigures
from kvcache_cli.serving.metrics import Latency
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec

# One decode step of GPT-2 small in a batch of 4 against the same row alone (a GEMM
# against the one-row product, summing in another order): logits differed by up to
# 5e-5 of the largest, and the difference grows along a generation as the cached keys
# drift apart too. A top-2 gap under 1e-3 of the largest logit is within that noise.
NEAR_TIE = 1e-3


@dataclass(frozen=True)
class Mismatch:
    """A request whose tokens left its solo generation's."""

    request: int
    step: int  # the first differing new token
    top2_gap: float  # the solo run's top-1 minus top-2 logit there
    logit_scale: float  # the largest |logit| there: float32 noise grows with it

    @property
    def near_tie(self) -> bool:
        """A gap within float32 noise of the logits' size: batched matmuls sum in another
        order than one row's, and a flipped near-tie sends greedy decoding elsewhere."""
        return self.top2_gap <= NEAR_TIE * self.logit_scale


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the run started
    running: int
    waiting: int  # arrived, not running
    kv_used_bytes: int  # blocks (or slabs) in use
    kv_real_bytes: int  # the part of them holding a real token's K and V


@dataclass(frozen=True)
class StepStats:
    """What the paged engine's forwards carried."""

    forwards: int
    prompt_tokens: int  # computed, recomputations included
    decode_tokens: int
    stalled: int  # sequence-forwards a sequence ready to decode waited while prompts ran
    tokens_per_forward: float  # mean
    budget_fill: float | None  # mean tokens / budget; None without a budget
    # Where the run's time went: scheduling (block tables, admission, preemption), forwards
    # that computed prompt tokens (mixed ones under decode-first), decode-only forwards.
    schedule_s: float = 0.0
    prompt_forward_s: float = 0.0
    decode_forward_s: float = 0.0


@dataclass(frozen=True)
class ServerMetrics:
    """What a server's Prometheus /metrics said about the run (vLLM's names), each None
    where the server does not export it. Counters are the run's difference (after - before);
    gauges were read before, sampled during and read after the run."""

    kv_usage_before: float | None  # vllm:kv_cache_usage_perc, 0..1 of its KV blocks
    kv_usage_peak: float | None  # the largest of the samples taken during the run
    kv_usage_after: float | None
    running_peak: int | None  # vllm:num_requests_running, the largest sampled
    preemptions: int | None  # vllm:num_preemptions_total
    prefix_queries: int | None  # vllm:prefix_cache_queries_total: prompt tokens looked up
    prefix_hits: int | None  # vllm:prefix_cache_hits_total: of them, found cached
    num_blocks: int | None  # vllm:cache_config_info: the KV blocks the server allocated
    block_size: int | None
    kv_cache_tokens: int | None  # ... and the tokens it says they hold
    samples: int  # /metrics reads during the run
    # The prompt tokens the run's own prompts could take from one another's blocks (ids sent,
    # the server's block size known): prefix_hits past it came from blocks held before.
    prefix_shared: int | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


@dataclass(frozen=True)
class Remote:
    """What a run against a server (`serve --target`) has beside the figures every engine
    has: which server, what it streamed, and its own metrics."""

    url: str
    model: str  # the served model's name
    server: str | None  # e.g. "vLLM 0.32.0" from its /version; None where it does not say
    endpoint: str  # the path the requests went to: /v1/completions
    stopped: int  # replies the server ended itself (finish_reason "stop")
    capped: int  # replies cut at max_tokens (finish_reason "length")
    prompt_tokens_differ: int  # requests whose prompt the server counted otherwise
    chunked: bool  # some chunk carried more than one token: ITL is between chunks
    metrics: ServerMetrics | None  # None: the server has no /metrics
    prompt_form: str = "ids"  # the prompts went as token ids, or as text it tokenized
    texts: tuple[str, ...] = ()  # each request's reply as the server streamed it, in order


@dataclass(frozen=True)
class HybridFigures:
    """The paged engine's pool on a model with sliding layers (`serving.hybrid_blocks`)."""

    keep_every: int  # tokens between the windows kept for later hits; 0: none kept
    page_bytes: int  # one page: block_size tokens of one group's layers, K and V
    groups: dict[str, int]  # groups of layers per kind ('full', 'sliding')
    peak_bytes: dict[str, int]  # per kind, the most bytes its pages held at once
    window_misses: int  # admissions whose full layers' hit a missing window cut short
    recomputed_tokens: int  # the prompt tokens those admissions computed again


@dataclass(frozen=True)
class EngineResult:
    engine: str  # the variant's name: "paged df 256" (`Variant.name`)
    setup_s: float  # one-time: pools, transformers' manager, a warm-up request
    total_s: float  # first arrival to last token
    output_tokens: int
    tokens_per_s: float  # output tokens / total_s
    latency: Latency  # vLLM's figures: TTFT, TPOT, ITL, E2E, throughputs, goodput
    kv_reserved_bytes: int | None  # what the engine holds for KV (pool, slabs)
    kv_peak_used_bytes: int | None  # blocks or slabs in use at the peak
    kv_utilisation: float | None  # real / in use, averaged over the run's time
    peak_running: int | None
    prefix_blocks_hit: int | None
    preemptions: int | None
    # requests whose tokens equal their solo generation's; None for a server (--target):
    # its replies come as text, and are not checked
    requests_exact: int | None
    mismatches: tuple[Mismatch, ...]
    timeline: tuple[Sample, ...]
    pool_tokens: int | None = None  # tokens the paged pool holds at once (its blocks x size)
    rate: float | None = None  # requests/s this run's arrivals came at; None: all at once
    policy: str | None = None
    token_budget: int | None = None
    steps: StepStats | None = None  # paged only
    over_sequential: float | None = None  # tokens/s ratios, filled in by run_serve
    over_padded: float | None = None
    over_hf: float | None = None
    # paged: the share of the shared prefix's full blocks served from the prefix cache to
    # every request after the first (the system prompt's, in a chat workload)
    shared_hit_rate: float | None = None
    remote: Remote | None = None  # a server's run (serve --target); None: kvcache's engine
    hybrid: HybridFigures | None = None  # paged on a model with sliding layers


@dataclass(frozen=True)
class Replies:
    """A chat workload's replies, as every request made alone made them."""

    stop_names: tuple[str, ...]  # the end-of-turn token(s), e.g. <|im_end|>
    cap: int
    shortest: int
    median: float
    longest: int
    stopped: int  # replies that ended at a stop token
    capped: int  # replies cut at the cap


def replies_of(requests: Sequence[Request], tokens: dict[int, list[int]],
               stop_names: Sequence[str]) -> Replies:
    import statistics

    lengths = [len(tokens[r.id]) for r in requests]
    stopped = sum(1 for r in requests if tokens[r.id] and tokens[r.id][-1] in r.stop_ids)
    return Replies(tuple(stop_names), max(r.max_new_tokens for r in requests), min(lengths),
                   statistics.median(lengths), max(lengths), stopped, len(requests) - stopped)


@dataclass(frozen=True)
class ServeResult:
    model: str
    weights_note: str | None
    device: str
    device_name: str
    cpus: int
    threads: int
    others_cpu_share: float | None  # other processes' share of CPU time during the run
    dtype: str
    torch_version: str
    transformers_version: str | None
    workload: WorkloadSpec
    prompt_tokens: int
    output_tokens: int
    kv_mem_bytes: int
    block_size: int
    n_blocks: int
    bytes_per_token: int  # K and V, every layer
    padded_rows: int  # rows of a padded group under kv_mem
    slab_len: int  # positions of one padded row
    max_batch: int
    prefix_sharing: bool
    engines: tuple[EngineResult, ...]  # every variant at every rate, rate by rate
    rates: tuple[float | None, ...] = (None,)
    goodput: dict[str, float] | None = None  # targets, ms
    replies: Replies | None = None  # a chat workload's reply lengths and stops
    pool: PoolFigures | None = None  # the pool under GQA, beside GPT-2 small's
    # Each request's solo (static cache) reply, in request order: what every engine's
    # tokens, and a server's text, are held against.
    solo_tokens: tuple[tuple[int, ...], ...] = ()

    def at(self, rate: float | None) -> tuple[EngineResult, ...]:
        return tuple(e for e in self.engines if e.rate == rate)
