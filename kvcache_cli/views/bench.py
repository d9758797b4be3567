"""Rich view of a `BenchResult`: what ran, every mode side by side, the limit,
and the per-step curve as sparklines.

Numbers are taken from the result untouched; `--json` prints the same object.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvcache_cli.bench.results import BenchResult, ModeResult
from kvcache_cli.views.plot import sparkline
from kvcache_cli.views.style import BAD, OK, figures_table, label_grid

# Other processes' share of CPU time above which the view warns: a few percent is
# the OS and daemons.
BUSY_SHARE = 0.05


def load_line(others_cpu_share: float) -> str:
    """The header's load row: other processes' share of the CPUs, flagged when it skews."""
    load = f"other processes used {others_cpu_share:.0%} of the CPUs' time during the run"
    if others_cpu_share > BUSY_SHARE:
        load = f"[yellow]{load}: they competed for the cores, and slowed these figures[/]"
    return load


SPARK_WIDTH = 24  # beside five latency columns, the table still fits 80 columns


def decimal_bytes(n: int | float | None) -> str:
    """Decimal units, like the GB/s beside them."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _num(x: float) -> str:
    """One decimal for small figures, none for large: narrow columns."""
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mode_column(table: Table, r: BenchResult) -> Table:
    """Mode names whole (hf-static-compiled is long): the figures give way instead."""
    table.columns[0].no_wrap = True
    table.columns[0].min_width = max(len(m.mode) for m in r.modes)
    return table


def _header(r: BenchResult) -> Table:
    grid = label_grid()
    grid.add_row("model", f"[bold]{r.model}[/], {r.n_params / 1e6:.1f}M parameters")
    for note in (r.weights_note, r.kernel_note):
        if note:
            grid.add_row("note", Text(note, style="yellow"))
    grid.add_row("device", f"[bold]{r.device}[/] ({r.device_name}, {r.cpus} CPUs), "
                 f"[bold]{r.dtype}[/], [bold]{r.threads} threads[/]")
    if r.weights_format != "fp32" or r.weights_check is not None:
        grid.add_row("weights", _weights_line(r))
    if r.cpu_half_support is not None:
        grid.add_row("half", f"the CPU {r.cpu_half_support} (without them, torch converts "
                     "half precision to float32 to multiply)")
    if r.others_cpu_share is not None:
        grid.add_row("load", load_line(r.others_cpu_share))
    grid.add_row("software", f"torch {r.torch_version}"
                 + (f", transformers {r.transformers_version}" if r.transformers_version else "")
                 + (f", llama-cpp-python {r.llama_cpp_version}" if r.llama_cpp_version else ""))
    grid.add_row("run", f"prompt {r.prompt_len} random token ids + {r.new_tokens} new tokens, "
                 f"greedy; {_repeats(r.repeats)}; "
                 f"a {r.warmup_tokens}-token warm-up per mode, not timed")
    if r.naive_samples is not None:
        grid.add_row("naive", f"timed at {r.naive_samples} of {r.new_tokens - 1} decode steps, "
                     f"spread evenly, each fed {r.reference_mode}'s tokens so far "
                     "(--naive-samples 0 times every step)")
    compiled = [m for m in r.modes if m.compile_s is not None]
    if compiled:
        grid.add_row("compile", ", ".join(f"{m.mode} {m.compile_s:.1f} s" for m in compiled)
                     + " to compile and warm up over a whole run, untimed")
    return grid


def _weights_line(r: BenchResult) -> str:
    """The products' format and, against float32, the logits' error and the tokens."""
    what = {"int8": "int8, one scale per output channel",
            "q4": "q4, the GGUF's own 4-bit blocks of 32 (products on bfloat16 rows)",
            "gguf": "gguf, the file's blocks as stored (products on float32 rows)",
            "gguf-q8": "gguf-q8, the file's blocks as stored (llama.cpp's: rows rounded to 8 "
                       "bits, integer dots)",
            "q8_0": "q8_0, llama.cpp's Q8_0 blocks of 32 (rows rounded to 8 bits, integer "
                    "dots)",
            "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[r.weights_format]
    line = f"[bold]{what}[/]; activations and cache {r.dtype}"
    c = r.weights_check
    if c is None:
        return line
    line += (f"; against float32: logits off by at most {c.logits_max_error:.3g} "
             f"({c.logits_rel_error:.2%} of the largest)")
    if c.same_tokens:
        return line + f", the same {c.new_tokens} greedy tokens"
    return line + f", greedy tokens differ from token {_margin(c.first_difference)}"


def _margin(m) -> str:
    """`12 (a near-tie: float32's margin 0.02, 0.1% of the logits' range)`."""
    kind = "a near-tie" if m.near_tie else "[red]not a near-tie[/]"
    return f"{m.step} ({kind}: the reference's margin {m.margin:.3g}, {m.share:.1%} of " \
        "the logits' range)"


def _speed(r: BenchResult) -> Table:
    # A ratio column only where its base ran: room for long mode names in 80 columns.
    ratios = [(f"×{base}", attr) for base, attr in
              (("naive", "speedup_over_naive"), ("hf", "ratio_to_hf"))
              if any(m.mode == base for m in r.modes)]  # fmt: skip
    table = figures_table(
        "mode", "tok/s", "spread", "ms/tok", "TTFT ms", *(name for name, _ in ratios), "tokens",
        title=f"decode, {r.new_tokens} tokens a run: the prefill's (TTFT), then "
        f"{r.new_tokens - 1} decode steps",
    )
    for m in r.modes:
        same = OK if m.same_tokens else (
            f"≠ @{m.first_difference} (evicts)" if _bounded(m.mode)
            else f"{BAD} @{m.first_difference}")
        if m.mode == r.reference_mode:
            same += " ref"
        table.add_row(
            f"[bold]{m.mode}[/]",
            f"[bold]{_num(m.tokens_per_s_median)}[/]",
            f"{_num(min(m.tokens_per_s))}-{_num(max(m.tokens_per_s))}",
            _num(m.ms_per_token_median),
            _num(m.ttft_ms_median),
            *(_ratio(getattr(m, attr)) for _, attr in ratios),
            same,
        )
    return _mode_column(table, r)


def _memory(r: BenchResult) -> Table:
    table = figures_table("mode", "GB/s", "MBU", "copied by appends", "cache held",
                   title="memory: bytes a step must read / step time (MBU: share of the "
                   "limit); what the cache moved")
    for m in r.modes:
        table.add_row(
            m.mode,
            f"{m.achieved_gbps:.1f}",
            f"{m.mbu:.0%}",
            decimal_bytes(m.bytes_copied),
            decimal_bytes(m.cache_bytes_held),
        )
    return _mode_column(table, r)


def _limit(r: BenchResult) -> Table:
    grid = label_grid()
    grid.add_row("[not dim bold]the limit[/]", "")
    for p in r.probes:
        best = f"[bold]{p.best_gbps:.1f} GB/s[/]" if p.name == r.limit_probe else (
            f"{p.best_gbps:.1f} GB/s")
        grid.add_row(f"{p.name} probe", f"{best} best, {p.median_gbps:.1f} median of "
                     f"{len(p.seconds)} runs: {p.what}")
    grid.add_row("a decode step reads", f"{decimal_bytes(r.weight_bytes)} of weights + "
                 f"{decimal_bytes(r.kv_bytes_per_token)} of K and V per token: "
                 f"{decimal_bytes(r.step_bytes_first)} @{r.profile_lengths[0]} to "
                 f"{decimal_bytes(r.step_bytes_last)} @{r.profile_lengths[-1]}")
    grid.add_row("the vocabulary's head", f"{decimal_bytes(r.head_bytes)} of those weights "
                 f"({r.head_bytes / r.weight_bytes:.0%}): {r.head_bytes / r.step_bytes_first:.0%}"
                 f" of a step's bytes @{r.profile_lengths[0]}, "
                 f"{r.head_bytes / r.step_bytes_last:.0%} @{r.profile_lengths[-1]}")
    grid.add_row("ceiling", f"[bold cyan]{r.ceiling_tokens_per_s:.1f} tokens/s[/] "
                 f"({r.limit_probe} probe's best {r.limit_gbps:.1f} GB/s, the limit / mean "
                 "bytes a step)")
    return grid


def _repeats(n: int) -> str:
    return "one run per mode, so no spread" if n == 1 else (
        f"median of {n} repeats, spread min-max")


def _profile(r: BenchResult) -> Table:
    table = figures_table("mode", *(f"@{n}" for n in r.profile_lengths), "every step, from 0 ms",
                   title="decode step latency (ms) at each context length "
                         f"(@{r.profile_lengths[0]}: {r.profile_lengths[0]} tokens attended)")
    table.columns[-1].justify = "left"
    for m in r.modes:
        table.add_row(m.mode, *(_num(ms) for ms in m.profile_ms),
                      f"[cyan]{sparkline(m.median_step_ms, SPARK_WIDTH)}[/]")
    return _mode_column(table, r)


def _bounded(mode: str) -> bool:
    """A bounded cache's mode (window, sink, h2o): its tokens may part from the exact ones."""
    from kvcache_cli.bench.modes import bounded_spec

    return bounded_spec(mode) is not None


def _verdict(r: BenchResult) -> Group:
    lines = [_tokens_verdict(r)]
    fastest = fastest_line(r)
    if fastest is not None:
        lines.append(Text.from_markup(fastest))
    return Group(*lines)


def _tokens_verdict(r: BenchResult) -> Text:
    if r.tokens_agree:
        sampled = "" if r.naive_samples is None else (
            f" (naive at its {r.naive_samples} timed steps and the first token)")
        bounded = [m for m in r.modes if _bounded(m.mode)]
        parted = ", ".join(f"{m.mode} from token {m.first_difference}"
                           for m in bounded if not m.same_tokens)
        aside = (f"; the bounded caches attend over what they kept and part from it: {parted}"
                 if parted else "")
        every = "every exact mode" if bounded else "every mode"
        return Text.from_markup(f"{OK} {every} generated the same {r.new_tokens} tokens as "
                                f"{r.reference_mode}{sampled}{aside}")

    def where(m: ModeResult) -> str:
        if m.difference_margin is not None:
            return f"{m.mode} from token {_margin(m.difference_margin)}"
        return f"{m.mode} from token {m.first_difference}"

    differ = ", ".join(where(m) for m in r.modes if not m.same_tokens and not _bounded(m.mode))
    return Text.from_markup(f"{BAD} tokens differ from {r.reference_mode}'s: {differ} "
                            f"(of {r.new_tokens}). Kernels that sum in another order, or "
                            "weights in another format, can flip a near-tie, and greedy "
                            "decoding then follows another path.")


def fastest_line(r: BenchResult) -> str | None:
    """The fastest peer against our fastest mode: tokens/s, the ratio, and the share of
    the limit each reaches (for the bytes its own step reads). None without both."""
    # Peers: transformers (hf*, its quanto cache) and llama.cpp; every other mode is ours.
    peers = [m for m in r.modes if m.mode.startswith(("hf", "llama.cpp", "quanto"))]
    ours = [m for m in r.modes if m not in peers]
    if not ours or not peers:
        return None
    mine = max(ours, key=lambda m: m.tokens_per_s_median)
    peer = max(peers, key=lambda m: m.tokens_per_s_median)
    ratio = mine.tokens_per_s_median / peer.tokens_per_s_median
    return (f"fastest peer [bold]{peer.mode}[/] {_num(peer.tokens_per_s_median)} tok/s at "
            f"{peer.mbu:.0%} of the limit ({decimal_bytes(peer.weight_bytes)} of weights a step); "
            f"ours [bold]{mine.mode}[/] {_num(mine.tokens_per_s_median)} tok/s at "
            f"{mine.mbu:.0%} ({decimal_bytes(mine.weight_bytes)}): [bold]{ratio:.2f}x[/] the peer")


def bench(r: BenchResult) -> RenderableType:
    return Group(_header(r), _speed(r), _profile(r), _memory(r), _limit(r), _verdict(r))


def render(r: BenchResult) -> RenderableType:
    return bench(r)




def profile_view(p) -> str:
    """`bench --profile` (a bench.profile.StepProfile) as the three lines the bench page
    quotes: what ran, the step split by kind of op (ms and share of the step), then the
    step against its products and its attention alone and the products' bandwidth."""
    fmt = p.weights if p.dtype in (p.weights, "fp32") else f"{p.dtype}+{p.weights}"
    cells = ", ".join(f"{kind} {ms:.2f} ({ms / p.step_ms:.0%})" for kind, ms in p.split_ms)
    t = p.parts
    parts = ", ".join(f"{name} {ms:.2f} ({ms / t.step_ms:.0%})" for name, ms in
                      (("products", t.products_ms), ("attention", t.attention_ms),
                       ("the rest", t.rest_ms)))
    # The parts alone are timed through their Python calls, so they are not subtracted
    # from the replayed step, which makes the same calls without Python.
    replayed = "" if t.replayed_step_ms is None else (
        f"\nreplayed: step {t.replayed_step_ms:.2f} ms, "
        f"{t.replayed_step_ms / t.step_ms:.2f}x the step above")
    return (f"{p.model}, {p.threads} threads, ms a decode step (share), {p.steps} steps "
            f"profiled\n{fmt}: step {p.step_ms:.2f} ms, {p.ops_per_step:.0f} ops: {cells}\n"
            f"alone, medians of {t.repeats} interleaved: step {t.step_ms:.2f} ms: {parts}; "
            f"products {t.product_gbps:.1f} GB/s, {t.product_share:.0%} of the "
            f"{t.limit_probe} limit {t.limit_gbps:.1f} GB/s{replayed}")
