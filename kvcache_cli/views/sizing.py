"""Rich views of `kvcache size` and `kvcache models`: the numbers in `sizing`'s results,
formatted for people. Nothing is computed here beyond unit formatting."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvcache_cli.sizing import (
    ModelRow,
    ModelShape,
    SizeResult,
    format_bytes,
    format_gib,
)
from kvcache_cli.views.layout import Formula

if TYPE_CHECKING:
    from kvcache_cli.sizing.cache_spec import SpecSize
    from kvcache_cli.sizing.reports import EngineFit, FrontEnd, LiveKinds, Verification

_KIND_LABEL = {
    "full": "full attention",
    "sliding": "sliding",
    "chunked": "chunked",
    "mla": "MLA latent",
    "recurrent": "recurrent state",
    "none": "no cache (MLP / shared KV)",
}


def _kind_label(shape: ModelShape, kind: str) -> str:
    if kind in ("sliding", "chunked"):
        return f"{_KIND_LABEL[kind]} ({shape.window:,})"
    return _KIND_LABEL[kind]


def _count(n: int | None, unit: str = "") -> str:
    return "no limit" if n is None else f"{n:,}{unit}"


def _headline(r: SizeResult) -> Panel:
    lines = Text()
    lines.append(format_bytes(r.total_bytes), style="bold green")
    lines.append(f"  for {r.seq:,} tokens × batch {r.batch:,}, {r.dtype} cache")
    lines.append("\n" if r.shape.has_kv else ": no attention layers, no KV cache\n")
    if r.state_bytes:
        lines.append("+ recurrent state ")
        lines.append(format_bytes(r.state_bytes), style="bold green")
        per = f": {format_bytes(r.state_bytes_per_sequence)}" if r.batch > 1 else ""
        lines.append(f"{per} per sequence, the same at any length\n")
    lines.append(f"per token: {r.bytes_per_token:,} bytes ({format_gib(r.bytes_per_token)})")
    lines.append(f" · per layer: {r.bytes_per_token_per_layer:,} bytes")
    if r.mha_total_bytes is not None:
        lines.append(f"\nmulti-head baseline: {format_bytes(r.mha_total_bytes)}")
        if r.reduction is not None:
            lines.append(" · reduction ")
            lines.append(f"{r.reduction:.1f}x", style="bold")
    shape = r.shape
    title = f"KV cache · {r.model}"
    if shape.source != "command-line flags":
        heads = f"{shape.heads} heads, " if shape.heads is not None else ""
        title += f": {shape.layers} layers, {heads}{shape.describe()}"
    return Panel(lines, title=title, subtitle=shape.source, title_align="left",
                 subtitle_align="left", box=box.ROUNDED)


def _kinds_table(r: SizeResult) -> Table:
    table = Table(title="per layer kind", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("layers", justify="right")
    table.add_column("kind")
    table.add_column("values/token", justify="right")
    table.add_column("bytes/token/layer", justify="right")
    table.add_column("tokens held", justify="right")
    table.add_column("total", justify="right")
    # A row is a count of layers of a kind: a part split off at 80 columns repeats both.
    table.key_columns = 2
    for row in r.kinds:
        table.add_row(
            f"{row.layers:,}",
            _kind_label(r.shape, row.kind),
            f"{row.values_per_token:,}",
            f"{row.bytes_per_token_per_layer:,}",
            f"{row.tokens_held:,}",
            format_gib(row.total_bytes),
        )
    return table


def _tp_table(r: SizeResult) -> RenderableType:
    tp = r.tp
    table = Table(title=f"tensor parallel, {tp.tp} GPUs", box=box.SIMPLE_HEAD,
                  title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    if not r.shape.is_mla:
        table.add_row("KV heads per GPU", f"{tp.kv_heads_per_gpu:,}")
    table.add_row("GPUs holding each copy", f"{tp.replicas:,}")
    table.add_row("bytes / token / GPU", f"{tp.bytes_per_token_per_gpu:,}")
    table.add_row("cache per GPU", format_bytes(tp.total_bytes_per_gpu))
    table.add_row("cache, all GPUs", format_bytes(tp.total_bytes_all_gpus))
    return Group(table, Text(tp.note, style="dim"), Text(""))


def _fit_table(r: SizeResult) -> RenderableType:
    fit = r.fit
    table = Table(title=f"fit on one GPU of {format_bytes(fit.gpu_mem_bytes)}",
                  box=box.SIMPLE_HEAD, title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row(f"weights ({fit.params:,} params × {fit.weight_dtype})",
                  format_bytes(fit.weights_bytes))
    if r.tp is not None:
        table.add_row("weights per GPU", format_bytes(fit.weights_bytes_per_gpu))
    table.add_row("room for the cache", format_bytes(fit.room_bytes))
    if fit.state_bytes_per_sequence:
        table.add_row("recurrent state per sequence" + (" per GPU" if r.tp is not None else ""),
                      format_bytes(fit.state_bytes_per_sequence))
    table.add_row("max tokens cached (one sequence, any length)", _count(fit.max_tokens))
    table.add_row(f"max sequences of {r.seq:,} tokens", _count(fit.max_sequences))
    verdict = Text("fits", style="green") if fit.batch_fits else Text("does not fit",
                                                                       style="bold red")
    table.add_row(f"--batch {r.batch:,} × {r.seq:,} tokens",
                  Text.assemble(format_bytes(fit.batch_bytes_per_gpu), ": ", verdict))
    if fit.block_size is not None:
        table.add_row(f"one sequence in {fit.block_size}-token blocks",
                      f"{format_bytes(fit.paged_bytes_per_sequence)} "
                      f"(+{fit.paged_waste_bytes_per_sequence:,} bytes rounding)")
        table.add_row("max sequences, paged", _count(fit.max_sequences_paged))
        table.add_row("max tokens, paged", _count(fit.max_tokens_paged))
    bound = "an upper bound: activations, the CUDA context and fragmentation are not counted"
    return Group(table, Text(bound, style="dim"), Text(""))


_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}


def engine_view(e: EngineFit) -> RenderableType:
    """--engine: the cache the engine allocates, the line it logs, the command and why."""
    name = _ENGINE_NAMES[e.engine]
    table = Table(title=f"{name}'s KV cache in {format_bytes(e.kv_bytes)}", box=box.SIMPLE_HEAD,
                  title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("memory for the cache", e.memory)
    table.add_row(f"bytes a token, every layer ({e.cache_dtype})", f"{e.bytes_per_token:,}")
    if e.num_blocks is not None:
        for g in e.groups if len(e.groups) > 1 else ():
            table.add_row(f"group: {g.layers} {_KIND_LABEL[g.kind]} layers",
                          f"{g.page_bytes:,} B a page, {g.blocks_per_request:,} blocks a request")
        layers = "every layer" if len(e.groups) == 1 else "a group's layers"
        tokens = "/".join(str(b) for b in sorted({g.block_size for g in e.groups}))
        table.add_row(f"one block: {tokens} tokens, {layers}", f"{e.bytes_per_block:,}")
        table.add_row("blocks", f"{e.num_blocks:,}")
    what = {"vllm": "KV cache size (tokens)", "sglang": "token pool (--max-total-tokens)",
            "llama.cpp": "cells (-c)"}[e.engine]
    table.add_row(what, f"{e.tokens:,}")
    table.add_row(f"requests of {e.max_model_len:,} tokens at once", f"{e.max_concurrency:.2f}x")
    parts: list[RenderableType] = [table]
    if len(e.front_ends) > 1:
        parts.append(_front_ends_view(e.front_ends))
    if e.log_line:
        parts.append(Text(f"{name} logs at start-up: {e.log_line}"))
    if not e.fits:
        parts.append(Text(f"one request of {e.max_model_len:,} tokens does not fit: {name} "
                          "refuses to start; expected more memory or a shorter --max-model-len",
                          style="bold red"))
    # A flag a line, continued as a shell continues it: the command is copied, not read.
    words = re.split(r" (?=--?[a-z])", e.command)
    lines = [f"  {words[0]} \\", *(f"      {w} \\" for w in words[1:-1]), f"      {words[-1]}"]
    parts += [Text(""), Text("command", style="bold"), Formula(lines, style="cyan")]
    flags = Table(title="each flag, and why", box=box.SIMPLE_HEAD, title_justify="left")
    flags.add_column("flag")
    flags.add_column("why")
    for f in e.flags:
        flags.add_row(f.flag, f.reason)
    parts.append(flags)
    for line in e.notes:
        parts.append(Text(f"note: {line}", style="dim"))
    return Group(*parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"  # as llama.cpp logs its buffers


def _front_ends_view(fronts: tuple[FrontEnd, ...]) -> RenderableType:
    """llama.cpp's two caches (non-SWA, SWA) as each front end allocates them, its log
    lines and how each is started."""
    table = Table(title="llama.cpp's KV buffers, per front end", box=box.SIMPLE_HEAD,
                  title_justify="left")
    for name, justify in (("front end", "left"), ("cache", "left"), ("layers", "right"),
                          ("cells", "right"), ("K + V", "right")):
        table.add_column(name, justify=justify)
    logs: list[Text] = []
    for f in fronts:
        for i, c in enumerate(f.caches):
            cache = "non-SWA" if c.kind == "full" else "SWA (full)" if f.swa_full else "SWA"
            cells = f"{c.cells:,}" + (f" × {c.streams}" if c.streams > 1 else "")
            table.add_row(f.name if i == 0 else "", cache, str(c.layers), cells,
                          _mib(c.k_bytes + c.v_bytes))
        table.add_row("", "total", "", "", _mib(f.total_bytes), style="bold", end_section=True)
        logs += [Text(f"{f.name}: {f.launch}", style="cyan", overflow="fold"),
                 *(Text(f"  {c.log_line}", overflow="fold") for c in f.caches)]
    return Group(table, Text("each started so, and what llama.cpp logs", style="bold"), *logs,
                 Text(""))


def verify_view(v: Verification) -> RenderableType:
    table = Table(title=f"--verify: transformers {v.model_type}, {v.tokens} tokens, {v.dtype}",
                  box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("kind")
    table.add_column("K shape")
    table.add_column("V shape")
    table.add_column("measured", justify="right")
    table.add_column("formula", justify="right")
    table.add_column("", justify="center")
    for layer in v.layers:
        same = layer.measured_bytes == layer.formula_bytes
        table.add_row(
            str(layer.index), layer.kind, str(layer.key_shape), str(layer.value_shape),
            f"{layer.measured_bytes:,}", f"{layer.formula_bytes:,}",
            Text("✓", style="green") if same else Text("✗", style="yellow"),
        )
    if v.state_measured_bytes or v.state_formula_bytes:
        same = v.state_measured_bytes == v.state_formula_bytes
        table.add_row("", "recurrent states", "", "", f"{v.state_measured_bytes:,}",
                      f"{v.state_formula_bytes:,}",
                      Text("✓", style="green") if same else Text("✗", style="yellow"))
    table.add_row("", "total K/V", "", "", f"{v.measured_bytes:,}", f"{v.formula_bytes:,}", "",
                  style="bold")
    notes = Text()
    for line in v.explanation:
        notes.append(f"• {line}\n")
    notes.append(f"built with: {'; '.join(v.changes)}", style="dim")
    return Group(table, notes)


def size_view(r: SizeResult) -> RenderableType:
    """Everything `kvcache size` shows, in reading order."""
    parts: list[RenderableType] = [_headline(r)]
    if r.formula:
        parts += [Text("formula", style="bold"),
                  Formula([f"  {line}" for line in r.formula], style="cyan")]
    parts.append(_kinds_table(r))
    if r.live is not None:
        parts.append(_live_table(r.live))
    if r.tp is not None:
        parts.append(_tp_table(r))
    if r.fit is not None:
        parts.append(_fit_table(r))
    if r.verify is not None:
        parts.append(verify_view(r.verify))
    if r.engine is not None:
        parts.append(engine_view(r.engine))
    if r.notes:
        notes = Text()
        for line in r.notes:
            notes.append(f"note: {line}\n", style="dim")
        parts.append(notes)
    return Group(*parts)


def _live_table(live: LiveKinds) -> RenderableType:
    """Every cache kind of a model kvcache runs, and the same model without GQA."""
    table = Table(title=f"every cache kind of {live.model} as kvcache runs it "
                  f"({live.dtype}, {live.seq:,} tokens, batch 1)", box=box.SIMPLE_HEAD,
                  title_justify="left")
    table.add_column("--cache")
    table.add_column("KV heads", justify="right")
    table.add_column("bytes held", justify="right")
    table.add_column("bytes/token", justify="right")
    table.add_column("vs static", justify="right")
    for k in live.kinds:
        table.add_row(k.spec, f"{k.kv_heads}", f"{k.bytes_held:,}", f"{k.bytes_per_token:,.1f}",
                      f"{k.ratio_to_static:.3f}x")
    m = live.mha
    table.add_row(Text("static, a KV head per query head (no GQA)", style="bold"),
                  f"{m.kv_heads}", f"{m.bytes_held:,}", f"{m.bytes_per_token:,.1f}",
                  Text(f"{m.ratio_to_static:.1f}x", style="bold"))
    left_out = Text(f"not counted here: {', '.join(live.left_out)} (transformers' "
                    "QuantizedCache, measured live only)", style="dim")
    return Group(table, left_out, Text(""))


def _params(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 10**9 else f"{n / 1e6:,.0f}M"


def models_view(rows: tuple[ModelRow, ...]) -> RenderableType:
    dtype = rows[0].dtype if rows else "fp16"
    table = Table(title=f"model presets (KV cache per token at {dtype})", box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("layers", justify="right", no_wrap=True)
    table.add_column("attention")
    table.add_column("head_dim", justify="right", no_wrap=True)
    table.add_column("KV / token", justify="right", no_wrap=True)
    table.add_column("context", justify="right", no_wrap=True)
    for row in rows:
        shape = row.shape
        table.add_row(
            row.name,
            _params(row.params),
            str(shape.layers),
            shape.describe(),
            str(shape.head_dim) if shape.has_kv else "",
            format_gib(row.bytes_per_token),
            f"{shape.max_positions:,}" if shape.max_positions else "",
        )
    table.caption = "use with: kvcache size --model NAME (Hub ids work too)"
    table.caption_justify = "left"
    return table


def spec_size_view(r: SpecSize) -> RenderableType:
    """`kvcache size --cache SPEC`: where the bytes go, beside the same tokens at fp16."""
    table = Table(title=f"{r.model}: --cache {r.spec}, {r.seq:,} tokens × {r.batch:,}, "
                  f"{r.layers} layers", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("part")
    table.add_column("tokens", justify="right")
    table.add_column("bytes / sequence", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    total = r.bytes_per_sequence or 1
    codes = r.quantised_tokens if r.payload_bytes else 0
    for part, tokens, n in (("codes (payload)", f"{codes:,}", r.payload_bytes),
                            ("scales + zero points", "", r.scale_bytes),
                            (f"full precision ({r.full_dtype})", f"{r.full_tokens:,}",
                             r.full_bytes)):
        table.add_row(part, tokens, format_bytes(n), f"{n / total:.1%}")
    table.add_row("total", f"{r.seq:,}", format_bytes(r.bytes_per_sequence), "",
                  style="bold")
    # What the spec is measured against: every token at fp16 (a bounded kind drops tokens, so
    # "the same" would not be the same cache).
    exact = ("every token at fp16" if r.quantised_tokens + r.full_tokens < r.seq
             else "the same at fp16")
    table.add_row(exact, f"{r.seq:,}", format_bytes(r.fp16_bytes_per_sequence),
                  f"total = {r.ratio_to_fp16:.3f}×")
    lines: list[RenderableType] = [
        table,
        Text(f"{r.bytes_per_token:,.1f} bytes per token of context; "
             f"{format_bytes(r.total_bytes)} for the batch"),
    ]
    lines += _per_kind_lines(r)
    if r.fit is not None:
        f = r.fit
        lines.append(Text(f"fit on one GPU of {format_bytes(f.gpu_mem_bytes)}, beside "
                          f"{format_bytes(f.weights_bytes)} of weights:"))
        fit = Table(box=box.SIMPLE_HEAD)
        fit.add_column("")
        fit.add_column(r.spec, justify="right")
        fit.add_column("fp16", justify="right")
        fit.add_row(f"sequences of {r.seq:,} tokens", f"{f.max_sequences:,}",
                    f"{f.fp16_max_sequences:,}")
        fit.add_row("longest single sequence", _count(f.max_tokens, " tokens"), "")
        lines.append(fit)
    lines += [Text(f"note: {n}", style="dim") for n in r.notes]
    return Group(*lines)


def _per_kind_lines(r: SpecSize) -> list[Text]:
    """A model with windowed layers: which layers hold the spec, the bytes per layer kind,
    and the other --sliding choice's bytes (the waste of the spec on every layer)."""
    if r.other_sliding_bytes is None:
        return []
    lines = [Text(f"per layer kind (--sliding {r.sliding}):")]
    for kind, layers, n in r.bytes_by_kind:
        if kind == "full" or r.sliding == "full":
            held = "the spec" + (", every position under its band" if kind != "full" else "")
        else:
            held = f"exact rings of their window at {r.ring_dtype}" \
                if r.ring_dtype == r.full_dtype else f"rings of their window in {r.ring_dtype}"
        lines.append(Text(f"  {kind}: {layers} layers, {held}: {format_bytes(n)}"))
    other = r.other_sliding_bytes
    if r.sliding == "model":
        lines.append(Text(f"--sliding full (the spec on every layer too): "
                          f"{format_bytes(other)}, {other / (r.bytes_per_sequence or 1):.2f}× "
                          "this: the waste of a full cache on the sliding layers"))
    else:
        lines.append(Text(f"--sliding model (the sliding layers in rings of their window): "
                          f"{format_bytes(other)}; this holds "
                          f"{format_bytes(r.bytes_per_sequence - other)} more"))
    return lines
