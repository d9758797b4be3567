"""The quantised caches' breaks: each symptom shows with the broken spec and not the fix."""

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.breaks.quantized import run_quant_break, with_outliers
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=128)


def model() -> GPT:
    # std 0.1: varied tokens, yet logits that a 4-bit cache does not scramble outright.
    return GPT(CONFIG, init_std=0.1, seed=0).eval()


def text(n: int = 80) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("which", ["k", "v"])
def test_outliers_leave_the_models_logits_as_they_were(which):
    m = model()
    idx = torch.tensor([text(20)])
    with torch.no_grad():
        torch.testing.assert_close(with_outliers(m, which, 1000.0)(idx, 0, None),
                                   m(idx, 0, None), rtol=1e-4, atol=1e-4)


def test_outlier_keys_hurt_one_scale_per_key_and_not_per_channel_scales():
    r = run_quant_break("kv-outlier-keys", model(), text(), 16)
    assert r.broken.mean_kl > 10 * r.fixed.mean_kl
    assert r.broken.top1_agreement < r.fixed.top1_agreement


def test_fp8_with_scale_one_saturates_far_more_than_a_calibrated_scale():
    r = run_quant_break("fp8-range", model(), text(), 16)
    assert r.broken.saturated > 20 * max(r.fixed.saturated, 1)  # later tokens may pass the prompt
    assert r.broken.mean_kl > 10 * r.fixed.mean_kl


def test_the_sink_token_is_read_exactly_only_when_kept():
    r = run_quant_break("kv-sink-token", model(), text(), 16)
    assert r.fixed.first_token_error == 0 < r.broken.first_token_error


def test_the_break_command_shows_the_fix_beside_the_damage(tmp_path):
    from kvcache_cli.models.gpt2 import to_hf

    to_hf(model()).save_pretrained(tmp_path / "tiny")
    out = CliRunner().invoke(app, ["break", "fp8-range", "--model", str(tmp_path / "tiny"),
                                   "--weights", "pretrained"], env={"COLUMNS": "140"})
    assert out.exit_code == 0, out.output
    for piece in ("fp8-e4m3:tensor:one", "fp8-e4m3:tensor:calib", "saturated", "mean KL"):
        assert piece in out.output


def test_the_verdict_fails_when_the_fix_does_not_bring_the_distribution_back():
    import dataclasses

    from rich.console import Console

    from kvcache_cli.breaks.quantized import RESTORED_KL
    from kvcache_cli.views.quant import quant_break_view

    r = run_quant_break("kv-outlier-keys", model(), text(), 16)
    assert r.restored == (r.fixed.mean_kl <= RESTORED_KL and r.fixed.top1_agreement >= 0.95)
    far = dataclasses.replace(r.fixed, mean_kl=4.3, top1_agreement=0.27)
    shown = dataclasses.replace(r, fixed=far, restored=False)
    console = Console(width=200, record=True)
    console.print(quant_break_view(shown))
    assert "✗ the fix does not bring it back: mean KL 4.3" in console.export_text()
