"""Rich views of `kvcache serve`: the engines side by side, or the batching sweep.

Numbers come from the result untouched; `--json` prints the same object.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvcache_cli.serving.batching import SweepResult
from kvcache_cli.serving.metrics import ATTAINMENT
from kvcache_cli.serving.results import EngineResult, ServeResult
from kvcache_cli.views.bench import decimal_bytes, load_line
from kvcache_cli.views.style import BAD, OK, figures_table, label_grid


def _opt(x, fmt: str = "{:,}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _header(r: ServeResult) -> Table:
    w = r.workload
    grid = label_grid()
    grid.add_row("model", f"[bold]{r.model}[/]")
    if r.weights_note:
        grid.add_row("note", Text(r.weights_note, style="yellow"))
    grid.add_row("device", f"[bold]{r.device}[/] ({r.device_name}, {r.cpus} CPUs), {r.dtype}, "
                 f"[bold]{r.threads} threads[/]")
    if r.others_cpu_share is not None:
        grid.add_row("load", load_line(r.others_cpu_share))
    arrivals = (f"at each of {', '.join(_rate(x) for x in r.rates)}" if len(r.rates) > 1
                else _rate(w.rate))
    if any(x is not None for x in r.rates) and w.burstiness != 1:
        arrivals += f" (gamma arrivals, burstiness {w.burstiness:g})"
    elif any(x is not None for x in r.rates):
        arrivals += " (Poisson arrivals)"
    if w.max_concurrency is not None:
        arrivals += f", at most {w.max_concurrency} in flight"
    prefix = f"a shared {w.shared_prefix}-token prefix + " if w.shared_prefix else ""
    if w.kind == "chat" and r.replies is not None:
        grid.add_row("workload", _chat_line(r, arrivals))
    else:
        grid.add_row("workload", f"{w.requests} requests, {prefix}prompts "
                     f"{w.prompt_len[0]}:{w.prompt_len[1]} and outputs "
                     f"{w.output_len[0]}:{w.output_len[1]} tokens (seed {w.seed}), {arrivals}: "
                     f"{r.prompt_tokens:,} prompt + {r.output_tokens:,} output tokens, greedy")
    hits = [e for e in r.at(r.rates[0]) if e.shared_hit_rate is not None]
    if hits:
        what = "system prompt" if w.kind == "chat" else "shared prefix"
        rates = ", ".join(f"{e.engine} [bold]{e.shared_hit_rate:.0%}[/]" for e in hits)
        grid.add_row("prefix cache", f"the {what}'s {w.shared_prefix // r.block_size} full "
                     f"blocks, served from the prefix cache to every request after the first: "
                     f"{rates}")
    sharing = "prefix sharing on" if r.prefix_sharing else "prefix sharing off"
    grid.add_row("KV memory", f"[bold]{decimal_bytes(r.kv_mem_bytes)}[/] for every engine "
                 f"({decimal_bytes(r.bytes_per_token)} a token): paged {r.n_blocks:,} blocks of "
                 f"{r.block_size} tokens, {sharing}; padded {r.padded_rows} rows of "
                 f"{r.slab_len} positions; at most {r.max_batch} sequences at once")
    if r.pool is not None and r.pool.bytes_per_token != r.pool.gpt2_bytes_per_token:
        grid.add_row("pool, GQA", _pool_line(r))
    for e in r.at(r.rates[0]):
        if e.remote is not None:
            grid.add_row("target", _target_line(e))
    if any(e.policy for e in r.engines):
        grid.add_row("policies", "paged pf: prefill-first (each prompt whole, alone; decodes "
                     "wait); paged df N: decode-first (decodes, then prompt chunks, N tokens "
                     "a forward)")
    if r.goodput:
        targets = ", ".join(f"{k.upper()} ≤ {ms:g} ms" for k, ms in r.goodput.items())
        grid.add_row("targets", f"{targets}: goodput counts the requests meeting every one; "
                     f"a run meets them when {ATTAINMENT:.0%} of its requests do")
    return grid


def _chat_line(r: ServeResult, arrivals: str) -> str:
    w, rp = r.workload, r.replies
    stops = "/".join(rp.stop_names)
    return (f"{w.requests} chat requests through the model's chat template ({w.source}, seed "
            f"{w.seed}): a shared {w.shared_prefix}-token system turn + user turns "
            f"{w.prompt_len[0]}:{w.prompt_len[1]} tokens; replies to {escape(stops)} or "
            f"{rp.cap} tokens: {rp.stopped} stopped, {rp.capped} capped, "
            f"{rp.shortest}:{rp.longest} tokens (median {rp.median:g}); {arrivals}: "
            f"{r.prompt_tokens:,} prompt + {r.output_tokens:,} output tokens, greedy")


def _target_line(e: EngineResult) -> str:
    """A server's row: who it is, what it was sent, what it streamed, what its /metrics said."""
    t = e.remote
    who = f"{escape(t.server)} at " if t.server else ""
    form = "as token ids" if t.prompt_form == "ids" else "as text it tokenizes again"
    line = (f"[bold]{e.engine}[/]: {who}{escape(t.url)}, model {escape(t.model)}; the same "
            f"prompts {form} to {t.endpoint}, streamed, greedy, timed as 'vllm bench "
            f"serve' times them; replies: {t.stopped} stopped, {t.capped} at the cap")
    if t.chunked:
        line += "; some chunks carried several tokens: ITL is between chunks"
    if t.prompt_tokens_differ:
        line += (f"; [yellow]the server counted {t.prompt_tokens_differ} prompts otherwise "
                 "(another tokenizer?)[/]")
    m = t.metrics
    if m is None:
        return line + "; no /metrics"
    pool = []
    if m.num_blocks is not None and m.block_size is not None:
        pool.append(f"{m.num_blocks:,} blocks of {m.block_size}")
    if m.kv_cache_tokens is not None:
        pool.append(f"{m.kv_cache_tokens:,} tokens")
    figures = [f"pool {' = '.join(pool)}"] if pool else []
    if m.kv_usage_peak is not None:
        figures.append(f"KV in use at most {m.kv_usage_peak:.0%} ({m.samples} samples, "
                       "one each half second)")
    if m.preemptions is not None:
        figures.append(f"{m.preemptions:,} preemptions")
    if m.prefix_hit_rate is not None:
        figures.append(f"prefix cache {m.prefix_hits:,} of {m.prefix_queries:,} prompt "
                       f"tokens ({m.prefix_hit_rate:.0%})" + _held_before(m))
    return line + ("; /metrics: " + ", ".join(figures) if figures else "; /metrics: none of "
                   "vLLM's KV figures")


def _held_before(m) -> str:
    """Where the server's prefix cache served more than the run's prompts share (with no
    preemption to re-read a request's own blocks): it held blocks from before the run."""
    if m.prefix_shared is None or m.preemptions != 0 or m.prefix_hits <= m.prefix_shared:
        return ""
    return (f", {m.prefix_hits - m.prefix_shared:,} more than the prompts share: held from "
            "before the run (vLLM empties its cache on POST /reset_prefix_cache, dev mode)")


def _pool_line(r: ServeResult) -> str:
    p = r.pool

    def batch(x) -> str:
        if x.peak_running is None:
            return "the longest request does not fit"
        return f"batch {x.peak_running}, {x.preemptions:,} preemptions"

    return (f"{p.bytes_per_token:,} B a token: [bold]{p.tokens_per_mib:,.1f}[/] tokens a MiB "
            f"against GPT-2 small's {p.gpt2_tokens_per_mib:,.1f} ({p.gpt2_bytes_per_token:,} B); "
            "this workload, all at once, prefill-first, replayed: in "
            f"{decimal_bytes(p.pool_bytes)} "
            f"{batch(p.at_pool)} (GPT-2 small: {batch(p.gpt2_at_pool)}); in a small "
            f"{decimal_bytes(p.small_pool_bytes)} {batch(p.at_small)} (GPT-2 small: "
            f"{batch(p.gpt2_at_small)})")


def _rate(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g} requests/s"


def _label(e: EngineResult, several_rates: bool) -> str:
    return f"{e.engine} @ {'inf' if e.rate is None else f'{e.rate:g}'}" if several_rates \
        else e.engine


def _ms(x: float) -> str:
    return "-" if x != x else f"{x:,.0f}"  # nan: no such gap (one-token outputs)


def _s(ms: float) -> str:
    """Seconds for TTFT and E2E: whole prefills and requests, where ms would run to 6 digits."""
    return "-" if ms != ms else f"{ms / 1e3:,.2f}"


def _named(table: Table) -> Table:
    table.columns[0].no_wrap = True  # "sequential" whole: the figures wrap instead
    return table


def _at(r: ServeResult, rate: float | None) -> str:
    return "" if len(r.rates) == 1 else f" · arrivals {_rate(rate)}"


def _speed(r: ServeResult, engines: tuple[EngineResult, ...]) -> Table:
    table = figures_table(
        "engine", "tok/s", "req/s", "run s", "setup s", "×seq", "×hf",
        *(["good/s"] if r.goodput else []),
        title="throughput: output tokens and requests a second over the run, set-up apart"
        + _at(r, engines[0].rate))
    _named(table)
    for e in engines:
        lat = e.latency
        good = [] if not r.goodput else [
            f"{lat.goodput:.2f} {OK if lat.meets_targets else BAD}"]
        table.add_row(
            f"[bold]{e.engine}[/]", f"[bold]{e.tokens_per_s:,.1f}[/]",
            f"{lat.request_throughput:.2f}", f"{e.total_s:,.1f}", f"{e.setup_s:,.1f}",
            _ratio(e.over_sequential), _ratio(e.over_hf), *good)
    return table


def _latency(r: ServeResult, engines: tuple[EngineResult, ...]) -> Table:
    table = figures_table(
        "engine", "TTFT s p50", "p99", "TPOT ms p50", "p99", "ITL ms p99", "max", "E2E s p99",
        title="latency per request as vLLM measures it" + _at(r, engines[0].rate))
    _named(table)
    for e in engines:
        lat = e.latency
        table.add_row(e.engine, _s(lat.ttft.p50), _s(lat.ttft.p99), _ms(lat.tpot.p50),
                      f"[bold]{_ms(lat.tpot.p99)}[/]", f"[bold]{_ms(lat.itl.p99)}[/]",
                      _ms(lat.itl.max), _s(lat.e2e.p99))
    return table


def token_steps(r: ServeResult) -> Table | None:
    """The ablation's step columns: what each paged policy's forwards carried."""
    rows = [e for e in r.engines if e.steps is not None and e.rate == r.rates[0]]
    if not rows:
        return None
    table = figures_table(
        "engine", "forwards", "tok/fwd", "fill", "prompt tok", "stalled", "s sched/prompt/decode",
        title="forwards: tokens each carried, budget filled; prompt tokens (recomputed "
        "included); decodes kept waiting by prompt forwards; seconds scheduling, in forwards "
        "with prompt tokens, in decode-only ones" + (
            _at(r, r.rates[0])))
    _named(table)
    for e in rows:
        st = e.steps
        table.add_row(e.engine, f"{st.forwards:,}", f"{st.tokens_per_forward:,.1f}",
                      _opt(st.budget_fill, "{:.0%}"), f"{st.prompt_tokens:,}",
                      f"[bold]{st.stalled:,}[/]", f"{st.schedule_s:.1f}/"
                      f"{st.prompt_forward_s:,.1f}/{st.decode_forward_s:,.1f}")
    return table


def _curve(r: ServeResult) -> RenderableType | None:
    """Across rates: throughput against p99 latency, and where the targets stop holding."""
    if len(r.rates) < 2:
        return None
    table = figures_table("engine", "rate", "tok/s", "req/s", "TTFT p99", "TPOT p99",
                          *(["good/s", "met"] if r.goodput else []), "= solo",
                          title="the curve: throughput against p99 latency at each rate, ms")
    _named(table)
    names = list(dict.fromkeys(e.engine for e in r.engines))
    lines = []
    for name in names:
        runs = [e for e in r.engines if e.engine == name]
        for e in runs:
            good = [] if not r.goodput else [
                f"{e.latency.goodput:.2f}", OK if e.latency.meets_targets else BAD]
            table.add_row(name, "inf" if e.rate is None else f"{e.rate:g}",
                          f"{e.tokens_per_s:,.1f}", f"{e.latency.request_throughput:.2f}",
                          _ms(e.latency.ttft.p99), _ms(e.latency.tpot.p99), *good,
                          _exact(r, e))
        if r.goodput:
            # The rates run slowest first, all at once last.
            failed = next((e for e in runs if not e.latency.meets_targets), None)
            if failed is None:
                lines.append(f"{OK} {name} meets the targets at every rate tried")
            else:
                lines.append(f"{BAD} {name} stops meeting the targets at {_rate(failed.rate)}")
    if not r.goodput:
        lines.append("give --goodput ttft:MS,tpot:MS to see where each engine stops meeting "
                     "its targets")
    return Group(table, *(Text.from_markup(x) for x in lines))


def _memory(r: ServeResult) -> Table:
    table = figures_table(
        "engine", "KV held", "tokens", "peak", "real", "seqs", "hits", "preempt", "= solo",
        title="KV memory: held, the tokens a pool holds, peak in use, the share holding real "
        "tokens; peak sequences running, prefix blocks hit, preemptions" + _at(r, r.rates[0]))
    _named(table)
    for e in r.at(r.rates[0]):
        if e.remote is not None:
            # A server's own /metrics: its pool's share in use at the peak sample, and
            # the prompt tokens its prefix cache served.
            m = e.remote.metrics
            peak = None if m is None else m.kv_usage_peak
            hits = None if m is None else m.prefix_hits
            table.add_row(e.engine, "-", _opt(e.pool_tokens), _opt(peak, "{:.0%} of pool"),
                          "-", _opt(e.peak_running), _opt(hits, "{:,} tok"),
                          _opt(e.preemptions), _exact(r, e))
            continue
        table.add_row(e.engine, decimal_bytes(e.kv_reserved_bytes), _opt(e.pool_tokens),
                      decimal_bytes(e.kv_peak_used_bytes),
                      _opt(e.kv_utilisation, "{:.1%}"), _opt(e.peak_running),
                      _opt(e.prefix_blocks_hit), _opt(e.preemptions), _exact(r, e))
    return table


def _hybrid(r: ServeResult) -> Table | None:
    """The paged engines' pool per layer kind, on a model with sliding layers."""
    runs = [e for e in r.at(r.rates[0]) if e.hybrid is not None]
    if not runs:
        return None
    h = runs[0].hybrid
    kinds = ", ".join(f"{n} {kind}" for kind, n in h.groups.items())
    table = figures_table(
        "engine", "page", "keep", "peak full", "peak sliding", "hits", "window misses",
        "recomputed",
        title=f"Hybrid pool: a page holds {r.block_size} tokens of one group of layers "
        f"(groups: {kinds}), in floats or a --kv-dtype's codes; the sliding groups give back "
        "blocks out of their window. Peak bytes per kind, prefix blocks hit, admissions whose "
        "hit a missing window cut short, the prompt tokens they recomputed"
        + _at(r, r.rates[0]))
    _named(table)
    for e in runs:
        x = e.hybrid
        table.add_row(e.engine, decimal_bytes(x.page_bytes),
                      f"every {x.keep_every:,}" if x.keep_every else "none",
                      decimal_bytes(x.peak_bytes.get("full")),
                      decimal_bytes(x.peak_bytes.get("sliding")), _opt(e.prefix_blocks_hit),
                      f"{x.window_misses:,}", f"{x.recomputed_tokens:,}")
    return table


def _exact(r: ServeResult, e: EngineResult) -> str:
    if e.requests_exact is None:  # a server's replies come as text: not checked
        return "-"
    return f"{BAD if e.mismatches else OK} {e.requests_exact}/{r.workload.requests}"


def _verdict(r: ServeResult) -> RenderableType:
    lines = []
    for e in r.engines:
        if e.mismatches and e.engine.startswith("paged-"):
            # Quantised blocks round every key and value: tokens that leave the float32
            # solo run are the format's cost (priced by `kvcache eval`), not a bug.
            first = min(e.mismatches, key=lambda m: m.step)
            lines.append(Text.from_markup(
                f"[yellow]~[/] {_label(e, len(r.rates) > 1)}: {len(e.mismatches)} of "
                f"{r.workload.requests} requests left their solo float32 tokens (the first at "
                f"new token {first.step}): a quantised cache's rounding, which "
                f"'kvcache eval' prices in perplexity and KL"))
            continue
        if e.remote is not None:
            lines += _server_lines(r, e)
            continue
        for m in e.mismatches:
            lines.append(Text.from_markup(
                f"{BAD} {_label(e, len(r.rates) > 1)}: request {m.request} left its solo "
                f"tokens at new token {m.step}: the solo top-2 logits are {m.top2_gap:.3g} apart, "
                f"{m.top2_gap / m.logit_scale:.1e} of the largest; "
                + ("a near-tie that float32 summation order can flip"
                   if m.near_tie else "not a near-tie: look for a bug")))
    unchecked = [e.engine for e in r.at(r.rates[0])
                 if e.remote is not None and e.requests_exact is None]
    if not lines:
        lines.append(Text.from_markup(
            f"{OK} every engine gave every request exactly its solo (static cache) tokens"
            + (f" ({', '.join(unchecked)}: its replies were not checked: the model's "
               "tokenizer is not at hand to read them)" if unchecked else "")))
    return Group(*lines)


def _server_lines(r: ServeResult, e) -> list[Text]:
    """A server's replies against the solo tokens: how many agree, and where each other
    one split, with kvcache's top-2 gap there (another engine sums in another order, and
    may run another dtype: a near-tie is expected to flip now and then)."""
    if not e.mismatches:
        return []
    splits = [m for m in e.mismatches if m.top2_gap == m.top2_gap]  # NaN: a length differs
    ties = sum(m.near_tie for m in splits)
    line = (f"[yellow]~[/] {_label(e, len(r.rates) > 1)}: {e.requests_exact} of "
            f"{r.workload.requests} replies are kvcache's solo tokens exactly")
    if splits:
        at = ", ".join(f"request {m.request} at token {m.step} (gap {m.top2_gap:.3g}, "
                       f"{m.top2_gap / m.logit_scale:.1e} of the largest)" for m in splits)
        line += f"; split at {at}: {ties} of {len(splits)} near-ties"
    if len(splits) < len(e.mismatches):
        line += (f"; {len(e.mismatches) - len(splits)} agreed as far as one went and "
                 "differ in length")
    return [Text.from_markup(line)]


def _sweep(r: SweepResult) -> RenderableType:
    grid = label_grid()
    grid.add_row("model", f"[bold]{r.model}[/]")
    grid.add_row("device", f"[bold]{r.device}[/] ({r.device_name}), {r.dtype}, "
                 f"[bold]{r.threads} threads[/]")
    grid.add_row("roofline", f"{r.bandwidth_gbps:.1f} GB/s (copy), {r.peak_gflops:,.0f} GFLOP/s "
                 f"(matmul), both measured now: ridge at {r.ridge:.1f} FLOPs/byte")
    grid.add_row("run", f"{r.steps} timed decode steps per batch at context {r.context}, median")
    table = figures_table("batch", "step ms", "tokens/s", "×batch 1", "FLOPs/byte",
                          "roofline ms", title="decode step time against batch size")
    for p in r.points:
        table.add_row(str(p.batch), f"{p.step_ms:,.1f}", f"[bold]{p.tokens_per_s:,.1f}[/]",
                      f"{p.over_batch1:.2f}x", f"{p.intensity:.1f}", f"{p.predicted_ms:,.1f}")
    if r.measured_knee is None:
        line = (f"no knee measured: up to batch {r.points[-1].batch} a step stays under twice "
                f"batch 1's; the roofline puts it at batch {_opt(r.predicted_knee, '{:.0f}')}")
    else:
        verdict = {True: f"{OK} agrees (within 2x)", False: f"{BAD} disagrees",
                   None: "no roofline knee to compare"}[r.agrees]
        line = (f"batching is nearly free up to batch ~{r.measured_knee:.0f} (a step costs "
                f"twice batch 1's there); the roofline predicts batch "
                f"{_opt(r.predicted_knee, '{:.0f}')}: {verdict}")
    return Group(grid, table, Text.from_markup(line))


def render(r: ServeResult | SweepResult) -> RenderableType:
    if isinstance(r, SweepResult):
        return _sweep(r)
    per_rate = [t for rate in r.rates for t in (_speed(r, r.at(rate)), _latency(r, r.at(rate)))]
    parts = [_header(r), *per_rate, token_steps(r), _curve(r), _memory(r), _hybrid(r),
             _verdict(r)]
    return Group(*(p for p in parts if p is not None))
