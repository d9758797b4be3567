"""Rich views of the quantised caches' breaks: the damage of the broken spec beside the fix."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from kvcache_cli.breaks.quantized import RESTORED_KL, RESTORED_TOP1, QuantBreakResult
from kvcache_cli.views.style import figures_table, mark


def quant_break_view(r: QuantBreakResult) -> RenderableType:
    table = figures_table("", "cache", "mean KL", "max KL", "top-1 = exact", "max |Δ logit|",
                          "token 0 |Δ|", "bytes/token", "saturated")
    for label, d in (("broken", r.broken), ("fixed", r.fixed)):
        saturated = "" if d.saturated is None else f"{d.saturated:,}"
        table.add_row(label, d.spec, f"{d.mean_kl:.2e}", f"{d.max_kl:.2e}",
                      f"{d.top1_agreement:.1%}", f"{d.max_logit_diff:.3g}",
                      f"{d.first_token_error:.2g}",
                      f"{d.bytes_per_token:,.0f}", saturated)
    lines: list[RenderableType] = [Text(f"broken: {r.broken_what}"),
                                   Text(f"fixed:  {r.fixed_what}")]
    if r.outliers:
        lines.append(Text(f"model: {r.outliers}; the exact cache's logits are unchanged"))
    lines += [table, Text.from_markup(
        f"against the exact cache, teacher-forced over {r.tokens} positions after a "
        f"{r.prompt_len}-token prompt: the broken spec's mean KL is "
        f"[bold]{r.damage_ratio:,.1f}×[/] the fix's")]
    if r.restored:
        verdict = (f"{mark(True)} the fix brings the next-token distribution back (mean KL "
                   f"≤ {RESTORED_KL}, top-1 ≥ {RESTORED_TOP1:.0%} against the exact cache)")
    else:
        verdict = (f"{mark(False)} the fix does not bring it back: mean KL "
                   f"{r.fixed.mean_kl:.2g} (≤ {RESTORED_KL} expected), top-1 "
                   f"{r.fixed.top1_agreement:.0%} (≥ {RESTORED_TOP1:.0%} expected); "
                   "a model that predicts well (-m smollm2) shows what the fix is worth")
    lines.append(Text.from_markup(verdict))
    return Panel(Group(*lines), title=f"break: {r.name} ({r.title})", title_align="left",
                 padding=(0, 1))
