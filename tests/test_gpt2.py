"""GPT-2 in PyTorch against transformers' GPT2LMHeadModel on the same weights; the two
caches' exactness and byte counts; loading (checkpoint, Hub cache, offline fallback)
that never runs a pickle's code.

The checkpoint is a random GPT2LMHeadModel saved with save_pretrained: a real checkpoint,
offline. Its weights are drawn with std 0.3 (GPT-2 uses 0.02) so that greedy tokens vary
and a bug has somewhere to show.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.exact import ConcatCache, StaticCache
from kvcache_cli.models import gpt2
from kvcache_cli.models.gpt2 import GPT, GPTConfig, load_gpt2, to_hf

# float32 has a 1.2e-7 unit roundoff; ours and transformers sum the same products in a
# different order (nn.Linear vs Conv1D, different SDPA kernels) through 2 layers, so
# logits of size ~10 agree to ~1e-5. 1e-4 leaves headroom and stays 10,000x below what
# any real bug does (a wrong position or mask moves logits by whole units).
TOL = dict(atol=1e-4, rtol=1e-4)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_hf(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=256,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object]:
    """(directory, the GPT2LMHeadModel saved there); tests only read both."""
    path = tmp_path_factory.mktemp("tiny-gpt2")
    hf = tiny_hf()
    hf.save_pretrained(path)
    return path, hf


def prompt(n: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, n), generator=g)  # (1, n)


# ---------------------------------------------------------------------------- parity


def test_parameter_names_are_hugging_face_names(checkpoint):
    path, hf = checkpoint
    ours = set(load_gpt2(str(path)).model.state_dict())
    assert ours == set(hf.state_dict())


def test_logits_equal_transformers_for_a_prompt(checkpoint):
    path, hf = checkpoint
    model = load_gpt2(str(path)).model
    idx = prompt(12)
    with torch.no_grad():
        ours, theirs = model(idx, 0), hf(idx).logits  # (1, 12, 256)
    assert theirs.abs().max() > 5  # logits big enough that a mismatch would show
    torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("mode", ["concat", "static"])
def test_logits_equal_transformers_after_cached_steps(checkpoint, mode):
    path, hf = checkpoint
    model = load_gpt2(str(path)).model
    idx = prompt(16, seed=1)
    with torch.no_grad():
        full = hf(idx).logits  # (1, 16, 256): every position at once, no cache
        cache = make_cache(mode, model, max_len=16)
        chunks = [model(idx[:, :8], 0, cache)]  # prefill
        for pos in range(8, 13):  # five single-token decode steps
            chunks.append(model(idx[:, pos : pos + 1], pos, cache))
        chunks.append(model(idx[:, 13:], 13, cache))  # a 3-token chunk onto the cache
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, **TOL)


def test_a_whole_static_cache_masks_every_slot_past_each_query(checkpoint):
    # Compiled, the model reads all max_len slots at every step (one shape); here the
    # slots not yet written hold noise, and the mask must hide every one of them.
    path, hf = checkpoint
    model = load_gpt2(str(path)).model
    idx = prompt(16, seed=1)
    with torch.no_grad():
        full = hf(idx).logits  # (1, 16, 256)
        cache = make_cache("static", model, max_len=32, whole=True)
        for buffer in cache.k + cache.v:
            buffer.normal_()
        chunks = [model(idx[:, :8], 0, cache)]  # prefill
        chunks += [model(idx[:, p : p + 1], p, cache) for p in range(8, 16)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, **TOL)


@pytest.mark.parametrize("mode", ["concat", "static"])
def test_cached_decode_is_exact_in_float64(checkpoint, mode):
    # In float64 the cache must agree with recomputation to rounding noise (1e-12):
    # it is the same arithmetic, not an approximation.
    path, _ = checkpoint
    model = load_gpt2(str(path), dtype=torch.float64).model
    idx = prompt(20, seed=2)
    with torch.no_grad():
        full = model(idx, 0)
        cache = make_cache(mode, model, max_len=20)
        steps = [model(idx[:, :5], 0, cache)]
        steps += [model(idx[:, p : p + 1], p, cache) for p in range(5, 20)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-12


def test_last_only_is_the_last_row_of_the_full_logits(checkpoint):
    model = load_gpt2(str(checkpoint[0])).model
    idx = prompt(11, seed=4)
    with torch.no_grad():
        full, last = model(idx, 0), model(idx, 0, last_only=True)
    assert last.shape == (1, 1, 256)
    torch.testing.assert_close(last, full[:, -1:], **TOL)


def test_to_hf_holds_the_same_weights(checkpoint):
    path, hf = checkpoint
    model = load_gpt2(str(path)).model
    idx = prompt(9, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(to_hf(model)(idx).logits, hf(idx).logits, atol=0, rtol=0)


def test_lm_head_is_tied_to_the_token_embedding(checkpoint):
    model = load_gpt2(str(checkpoint[0])).model
    assert model.lm_head.weight is model.transformer.wte.weight


# ---------------------------------------------------------------------------- caches


def test_concat_copies_the_whole_history_static_only_the_new_tokens():
    config = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, init_std=0.3).eval()
    per_pos = 2 * config.n_layer * config.n_embd * 4  # K and V, all layers, float32 bytes
    concat, static = make_cache("concat", model, 32), make_cache("static", model, 32)
    assert isinstance(concat, ConcatCache) and isinstance(static, StaticCache)
    with torch.no_grad():
        for cache in (concat, static):
            cache_prompt = prompt(4) % 64
            model(cache_prompt, 0, cache)
            for pos in range(4, 10):
                model(torch.tensor([[pos]]), pos, cache)
    # concat re-copies everything it holds at each append: 4 + 5 + 6 + ... + 10 positions
    assert concat.bytes_copied == sum(range(4, 11)) * per_pos
    assert concat.bytes_held == 10 * per_pos
    # static copies each position once, and holds its 32 slots from the start
    assert static.bytes_copied == 10 * per_pos
    assert static.bytes_held == 32 * per_pos
    assert concat.length == static.length == 10
    for cache in (concat, static):
        cache.reset()
        assert cache.length == 0 and cache.bytes_copied == 0


def test_static_cache_refuses_a_position_past_its_slots():
    config = GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config).eval()
    cache = make_cache("static", model, max_len=8)
    with torch.no_grad(), pytest.raises(IndexError, match="position 8 past the static cache's 8"):
        model(torch.zeros(1, 9, dtype=torch.long), 0, cache)


def test_forward_refuses_a_position_past_the_context_window():
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config).eval()
    with pytest.raises(IndexError, match="position 16 past context window 16"):
        model(torch.zeros(1, 1, dtype=torch.long), 16)


def test_make_cache_rejects_an_unknown_mode():
    model = GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=4))
    assert make_cache("naive", model, 8) is None
    with pytest.raises(ValueError, match="unknown cache 'ring'"):
        make_cache("ring", model, 8)


# ---------------------------------------------------------------------------- loading


class _RunsCode:
    """A pickle payload: unpickling it calls Path.touch(marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_that_would_run_code_is_refused_and_never_run(checkpoint, tmp_path):
    src, _ = checkpoint
    bad = tmp_path / "bad-checkpoint"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    marker = tmp_path / "pwned"
    torch.save({"transformer.wte.weight": _RunsCode(marker)}, bad / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's note on the pickle protocol is not passed on
        with pytest.raises(ValueError, match="refusing .*pytorch_model.bin") as refused:
            load_gpt2(str(bad))
    # what torch refused, not its paragraph on weights_only's default
    assert "Unsupported global" in str(refused.value) and "PyTorch 2.6" not in str(refused.value)
    assert not marker.exists()
    # The payload is live: an unrestricted unpickle does run it.
    torch.load(bad / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_a_plain_tensor_pickle_loads_like_safetensors(checkpoint, tmp_path):
    src, hf = checkpoint
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = load_gpt2(str(tmp_path)).model
    idx = prompt(6)
    with torch.no_grad():
        torch.testing.assert_close(model(idx, 0), hf(idx).logits, **TOL)


def test_checkpoint_with_an_unsupported_option_is_refused(checkpoint, tmp_path):
    src, _ = checkpoint
    config = json.loads((src / "config.json").read_text())
    config["activation_function"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_function='relu' is not supported"):
        load_gpt2(str(tmp_path))


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="expected gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        load_gpt2("gpt3")
    with pytest.raises(ValueError, match="unknown weights 'some'"):
        load_gpt2("gpt2", weights="some")


TINY = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache, HF_HUB_OFFLINE on, and 'gpt2' shrunk to TINY."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setitem(gpt2.PRESETS, "gpt2", TINY)
    return tmp_path / "hub"


def test_auto_falls_back_to_random_weights_with_one_line(offline_hub):
    loaded = load_gpt2("gpt2", weights="auto")
    assert loaded.source.startswith("random weights (gpt2 shape")
    assert "pretrained gpt2 weights unavailable" in loaded.note
    assert "\n" not in loaded.note
    assert loaded.model.config == TINY


def test_pretrained_without_weights_is_a_runtime_error_offering_the_offline_ways(offline_hub):
    with pytest.raises(RuntimeError, match="pretrained gpt2 weights unavailable.*HF_HUB_OFFLINE"
                       ".*--weights random.*-m stdlib-bytes"):
        load_gpt2("gpt2", weights="pretrained")


def test_auto_uses_weights_from_the_hugging_face_cache(offline_hub, checkpoint):
    # The Hub cache layout: refs/main names a snapshot holding the files.
    path, hf = checkpoint
    repo = offline_hub / "models--openai-community--gpt2"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    os.symlink(path / "model.safetensors", snapshot / "model.safetensors")
    loaded = load_gpt2("gpt2", weights="auto")
    assert loaded.source == "pretrained gpt2 (cached)" and loaded.note is None
    idx = prompt(7)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(idx, 0), hf(idx).logits, **TOL)


def test_random_weights_are_seeded_and_read_no_file(checkpoint):
    path, _ = checkpoint
    a = load_gpt2(str(path), weights="random").model
    b = load_gpt2(str(path), weights="random").model
    assert a.config == b.config
    assert torch.equal(a.transformer.wte.weight, b.transformer.wte.weight)
    assert a.transformer.wte.weight.std().item() == pytest.approx(gpt2.RANDOM_INIT_STD, rel=0.05)
