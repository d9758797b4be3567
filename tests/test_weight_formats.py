"""Weight formats: int8 weight-only products with one scale per output channel, float
matrices in a dtype of their own, the bytes a step reads, and the checks that refuse a
format a model or device cannot run before any weights load."""

from __future__ import annotations

import copy

import pytest
import torch

from kvcache_cli.generate import stream_tokens
from kvcache_cli.measure import weight_bytes
from kvcache_cli.models import linear, set_weights_dtype
from kvcache_cli.models.gpt2 import GPT, GPTConfig
from kvcache_cli.models.linear import Int8Linear, float_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)


def tiny() -> GPT:
    return GPT(CONFIG, init_std=0.2, seed=0).eval()


def prompt(n: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (1, n), generator=g)  # (1, n)


def test_int8_keeps_one_scale_per_output_channel_and_rounds_to_the_nearest_step():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight.shape == (48, 64)
    assert q.scales.shape == (48,)
    assert (q.weight.abs().amax(dim=1) == 127).all()  # each row's largest |w| maps to 127
    # Rounding error at most half a step; the bfloat16 scale adds its own 2^-9 relative.
    step = q.scales.float()[:, None]
    error = (q.dequantized() - linear.weight.detach()).abs()
    assert (error <= step / 2 + linear.weight.detach().abs() * 2**-8).all()


def test_int8_product_matches_the_dequantised_float_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = Int8Linear(linear)
    x = torch.randn(3, 5, 64)
    expected = x @ q.dequantized().t() + linear.bias.detach()  # (3, 5, 48)
    # The row is rounded to bfloat16 (8 bits of mantissa) before the product: ~0.4%
    # of the output's scale, far below a wrong scale or transpose (whole units).
    torch.testing.assert_close(q(x), expected, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp16"])
def test_a_weight_format_keeps_activations_float32_and_logits_near(fmt):
    model = tiny()
    with torch.inference_mode():
        reference = model(prompt(), 0)
        other = set_weights_dtype(copy.deepcopy(model), fmt)
        logits = other(prompt(), 0)
    assert other.dtype == torch.float32 and linear.weights_format(other) == fmt
    assert logits.dtype == torch.float32
    # 8 bits of weight (int8) or of mantissa (bf16) through two layers of std-0.2 weights
    # move logits of size ~30 by well under 2%; a wrong scale or layout moves them by 100%.
    scale = reference.abs().max()
    assert (logits - reference).abs().max() / scale < 0.05


def test_the_tied_head_gets_its_own_copy_and_the_embedding_keeps_its_dtype():
    model = set_weights_dtype(tiny(), "bf16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.transformer.wte.weight.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_stored_format_counts_the_parameters_it_stands_for(fmt):
    # int8 holds its matrices as buffers and bf16 unties the head: the header's count is
    # still the model's, the float32 one, not what `parameters()` happens to hold.
    floats = sum(p.numel() for p in tiny().parameters())
    assert set_weights_dtype(tiny(), fmt).num_params() == floats == CONFIG.param_count()


def test_int8_greedy_tokens_vary_and_run_through_every_cache_loop():
    model = set_weights_dtype(tiny(), "int8")
    ids = prompt()[0].tolist()
    with torch.inference_mode():
        static = list(stream_tokens(model, ids, 16, "static"))
        concat = list(stream_tokens(model, ids, 16, "concat"))
        naive = list(stream_tokens(model, ids, 16, "naive"))
    assert len(set(static)) > 3  # the tokens vary, so agreement below means something
    assert static == concat == naive


def test_a_step_reads_the_int8_matrices_their_scales_and_one_embedding_row():
    model = tiny()
    float_bytes = weight_bytes(model)
    int8 = set_weights_dtype(copy.deepcopy(model), "int8")
    C, V, L = CONFIG.n_embd, CONFIG.vocab_size, CONFIG.n_layer
    matrices = L * (3 * C * C + C * C + 4 * C * C * 2) + V * C  # one byte each, head included
    scales = 2 * (L * (3 * C + C + 4 * C + C) + V)  # bfloat16, one per output channel
    biases = 4 * L * (3 * C + C + 4 * C + C)
    norms = 4 * (2 * L + 1) * 2 * C
    rows = 4 * 2 * C  # one row each of wte and wpe, float32
    assert weight_bytes(int8) == matrices + scales + biases + norms + rows
    assert weight_bytes(int8) < float_bytes / 3


def test_float_state_holds_what_the_model_computes_with():
    model = set_weights_dtype(tiny(), "int8")
    state = float_state(model)
    assert not any(name.endswith(".scales") for name in state)
    assert all(t.dtype == torch.float32 for t in state.values())
    layer = model.transformer.h[0].attn.c_attn
    assert torch.equal(state["transformer.h.0.attn.c_attn.weight"], layer.dequantized())


def test_unknown_weights_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown weights dtype 'int4'; expected fp32, bf16"):
        linear.check_weights_dtype("int4", CONFIG, "cpu")


def test_int8_is_refused_off_the_cpu_and_for_widths_its_kernel_cannot_run():
    with pytest.raises(ValueError, match="int8 weights run on the CPU only"):
        linear.check_weights_dtype("int8", CONFIG, "cuda")
    odd = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=72)
    with pytest.raises(ValueError, match="n_embd a multiple of 16.*72"):
        linear.check_weights_dtype("int8", odd, "cpu")
    linear.check_weights_dtype("int8", CONFIG, "cpu")  # 64 is fine


def test_float32_checked_against_itself_has_no_error_and_the_same_tokens():
    from kvcache_cli.bench.weight_check import check_weights

    model = tiny()
    check = check_weights(model, copy.deepcopy(model), prompt()[0].tolist(), 12)
    assert check.weights == "fp32" and check.logits_max_error == 0.0
    assert check.same_tokens and check.first_difference is None


def test_a_flip_is_a_near_tie_only_within_the_measured_logit_error():
    from kvcache_cli.bench.weight_check import token_margin

    model = tiny()
    ids = prompt()[0].tolist()
    with torch.inference_mode():
        tokens = list(stream_tokens(model, ids, 6, "static"))
        logits = model(torch.tensor([ids + tokens[:3]]), 0, None)[0, -1]  # step 3's
    second = int(logits.topk(2).indices[1])
    other = tokens[:3] + [second] + tokens[4:]
    gap = float(logits.topk(2).values[0] - logits.topk(2).values[1])
    flip = token_margin(model, ids, tokens, other, logit_error=gap)
    assert flip.step == 3 and flip.margin == pytest.approx(gap, rel=1e-4) and flip.near_tie
    assert not token_margin(model, ids, tokens, other, logit_error=gap / 4).near_tie
    assert token_margin(model, ids, tokens, tokens) is None
