"""Generation: the three modes and transformers' generate() pick the same greedy tokens;
streaming, sampling and the context-window check; the three torch breaks diverge while
the correct loop does not; `kvcache generate` and the GPT-2 breaks through CliRunner.

The model is a random GPT2LMHeadModel (std 0.3, so greedy tokens vary) saved with
save_pretrained: a real checkpoint, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.breaks.loop import BREAKS, run_break
from kvcache_cli.caches import make_cache
from kvcache_cli.cli import app
from kvcache_cli.generate import MODES, generate, stream_tokens
from kvcache_cli.models.gpt2 import load_gpt2

PROMPT = [17, 200, 3, 91, 45]
N_NEW = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object]:
    """(directory, the GPT2LMHeadModel saved there); tests only read both."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=256,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    hf = GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("tiny-gpt2")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture
def model(checkpoint):
    return load_gpt2(str(checkpoint[0])).model


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    idx = torch.tensor([prompt])
    out = hf.generate(
        idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------- modes


def test_greedy_tokens_vary_and_agree_across_modes_and_transformers(checkpoint, model):
    _, hf = checkpoint
    tokens = {mode: list(stream_tokens(model, PROMPT, N_NEW, mode)) for mode in MODES}
    tokens["hf"] = hf_greedy(hf, PROMPT, N_NEW)
    assert len(set(tokens["naive"])) >= 8  # the model wanders, so agreement means something
    assert len(tokens["naive"]) == N_NEW
    for mode, seq in tokens.items():
        assert seq == tokens["naive"], mode


def test_first_token_comes_right_after_the_prefill(model):
    cache = make_cache("static", model, len(PROMPT) + 4)
    stream = stream_tokens(model, PROMPT, 4, "static", cache=cache)
    assert cache.length == 0  # nothing runs before the first next()
    next(stream)
    assert cache.length == len(PROMPT)  # the prompt only: no decode step yet
    next(stream)
    assert cache.length == len(PROMPT) + 1
    rest = list(stream)
    assert len(rest) == 2 and cache.length == len(PROMPT) + 3  # the last token is not fed


def test_generate_reports_tokens_timing_and_cache_bytes(model):
    concat = generate(model, PROMPT, 8, "concat")
    static = generate(model, PROMPT, 8, "static")
    naive = generate(model, PROMPT, 8, "naive")
    assert concat.tokens == static.tokens == naive.tokens and len(static.tokens) == 8
    assert static.first_token_s > 0 and static.decode_s > 0
    assert concat.cache_bytes_copied > static.cache_bytes_copied > 0
    assert naive.cache_bytes_held == naive.cache_bytes_copied == 0
    seen: list[int] = []
    generate(model, PROMPT, 5, "static", on_token=seen.append)
    assert seen == list(static.tokens[:5])


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    def sampled(seed: int, **kw) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return list(stream_tokens(model, PROMPT, 16, "static", generator=g, **kw))

    greedy = list(stream_tokens(model, PROMPT, 16, "static"))
    assert sampled(1, temperature=1.0) == sampled(1, temperature=1.0)
    assert sampled(1, temperature=1.0) != greedy
    assert sampled(2, temperature=1.0, top_k=1) == greedy


def test_generation_past_the_window_errors_before_starting(model):
    # 5 prompt tokens + 60 new ones need positions 0..64; the window is 0..63.
    with pytest.raises(IndexError, match="position 64 past context window 64"):
        stream_tokens(model, PROMPT, 60, "static")  # raised at the call, not at next()
    assert len(list(stream_tokens(model, PROMPT, 59, "static"))) == 59  # the last that fits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(spec="ring"), "unknown mode 'ring'"),
        (dict(spec="static", temperature=-1.0), "temperature must be >= 0"),
        (dict(spec="static", top_k=0), "top_k must be >= 1"),
    ],
)
def test_bad_requests_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        stream_tokens(model, PROMPT, 4, **kwargs)


def test_token_ids_outside_the_vocabulary_are_refused(model):
    with pytest.raises(ValueError, match="token id 300 outside the vocabulary 0..255"):
        stream_tokens(model, [1, 300], 4, "static")


# ---------------------------------------------------------------------------- breaks


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_break_diverges_and_the_correct_loop_does_not(model, name):
    r = run_break(name, model, PROMPT, N_NEW)
    assert len(set(r.correct)) >= 8  # varied tokens, so a divergence can show
    # the correct cached loop equals a full recompute, to float32 noise
    assert r.naive_agrees and r.naive_logit_diff < 1e-4
    # the broken loop parts from it, by whole logit units
    assert r.first_divergence is not None
    assert r.correct[: r.first_divergence] == r.broken[: r.first_divergence]
    assert r.correct[r.first_divergence] != r.broken[r.first_divergence]
    assert r.max_logit_diff > 1.0
    assert len(r.step_logit_diff) == r.first_divergence + 1


def test_break_control_is_exact_in_float64(checkpoint):
    # The control compares the correct cached loop with a full recompute: in float64
    # any gap beyond rounding (1e-12 on logits of size ~10) would be a cache bug.
    model = load_gpt2(str(checkpoint[0]), dtype=torch.float64).model
    r = run_break("position-offset", model, PROMPT, N_NEW)
    assert r.naive_agrees and r.naive_logit_diff <= 1e-12 < r.max_abs_logit


@pytest.mark.parametrize("name", ["position-offset", "causal-decode"])
def test_decode_bugs_leave_the_prefill_untouched(model, name):
    # Both bugs live in the decode call; the prefill (positions 0.., square mask) is right.
    r = run_break(name, model, PROMPT, N_NEW)
    assert r.step_logit_diff[0] == 0.0
    assert r.first_divergence >= 1


def test_stale_cache_changes_even_the_first_token_logits(model):
    r = run_break("stale-cache", model, PROMPT, N_NEW)
    assert r.earlier_ids and r.step_logit_diff[0] > 1.0


def test_a_static_cache_with_explicit_positions_survives_reuse(model):
    # Reads stop at the filled prefix and writes land at the given positions, so a
    # second request overwrites the first instead of attending to it.
    r = run_break("stale-cache", model, PROMPT, N_NEW, spec="static")
    assert r.first_divergence is None and r.max_logit_diff < 1e-4


# ---------------------------------------------------------------------------- CLI

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "100"})


def test_cli_generate_streams_the_tokens_of_a_checkpoint(checkpoint, model):
    path, _ = checkpoint
    expected = generate(model, PROMPT, 12, "static").tokens
    ids = ",".join(map(str, PROMPT))
    result = invoke("generate", "--model", str(path), "--ids", ids, "-n", "12")
    assert result.exit_code == 0, result.output
    assert f"checkpoint {path}" in result.stdout
    assert " ".join(map(str, PROMPT + list(expected))) in result.stdout.replace(" |", "")
    assert "12 new after a 5-token prompt" in result.stdout


@pytest.mark.parametrize("mode", MODES)
def test_cli_generate_json_for_every_mode(checkpoint, model, mode):
    path, _ = checkpoint
    ids = ",".join(map(str, PROMPT))
    result = invoke("generate", "--model", str(path), "--ids", ids, "-n", "6", "--mode", mode,
                    "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["mode"] == mode and data["prompt_ids"] == PROMPT
    assert data["tokens"] == list(generate(model, PROMPT, 6, "static").tokens)
    assert data["model"] == f"checkpoint {path}" and data["text"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_device_cuda_without_cuda_is_one_line_exit_2(checkpoint):
    result = invoke("generate", "--model", str(checkpoint[0]), "--ids", "1,2", "--device", "cuda")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: --device cuda: CUDA is not available")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--ids", "1,2,3", "-n", "70"], 2, "error: position 72 past context window 64"),
        (["--ids", "1,x"], 2, "error: --ids: expected comma-separated token ids"),
        (["--ids", "1,999"], 2, "error: token id 999 outside the vocabulary 0..255"),
        ([], 2, 'error: no prompt: expected one, e.g. kvcache generate "The KV cache"'),
        (["a", "--prompt", "b"], 2, "error: two prompts, 'a' and --prompt 'b'"),
        (["a", "--ids", "1"], 2, "error: a prompt and --ids: expected one of the two"),
    ],
)
def test_cli_generate_bad_input_is_one_line(checkpoint, args, code, message):
    result = invoke("generate", "--model", str(checkpoint[0]), *args)
    assert result.exit_code == code, result.output
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert result.stdout == ""  # refused before anything was streamed


class ByteEncoding:
    """A stand-in for tiktoken's gpt2 encoding (whose files cannot be fetched offline):
    one token per UTF-8 byte, so multi-byte characters arrive split across tokens."""

    def encode(self, text: str, disallowed_special=()) -> list[int]:
        return list(text.encode())

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(t % 256 for t in ids)

    def decode_single_token_bytes(self, token: int) -> bytes:
        return bytes([token % 256])

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode(errors="replace")


@pytest.fixture(scope="module")
def gpt2_vocab_checkpoint(tmp_path_factory) -> Path:
    """A tiny random checkpoint with GPT-2's 50,257-token vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, initializer_range=0.3)
    path = tmp_path_factory.mktemp("tiny-gpt2-vocab")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_cli_text_prompt_is_encoded_and_streamed_as_text(gpt2_vocab_checkpoint, monkeypatch):
    import kvcache_cli.models.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "gpt2_encoding", lambda: (ByteEncoding(), None))
    path = str(gpt2_vocab_checkpoint)
    result = invoke("generate", "héllo", "--model", path, "-n", "8", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["prompt_ids"] == list("héllo".encode())
    assert data["text"] == ByteEncoding().decode(data["tokens"])
    shown = invoke("generate", "héllo", "--model", path, "-n", "8")
    assert shown.exit_code == 0, shown.output
    assert "héllo" in shown.stdout  # the prompt's two-byte é, whole again


def test_token_stream_holds_a_split_character_until_it_is_whole():
    import io

    from rich.console import Console

    from kvcache_cli.views.generate import TokenStream

    out = io.StringIO()
    stream = TokenStream(Console(file=out, width=100), ByteEncoding())
    stream.prompt(list(b"caf"))
    stream(0xC3)  # the first byte of é: nothing printable yet
    assert out.getvalue() == "caf"
    stream(0xA9)
    stream(ord("!"))
    stream.end()
    assert out.getvalue() == "café!\n"


def test_cli_text_prompt_without_a_tokenizer_says_use_ids_or_the_offline_model(
        checkpoint, monkeypatch):
    import kvcache_cli.models.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "gpt2_encoding", lambda: (None, "tiktoken is not installed"))
    result = invoke("generate", "hello", "--model", str(checkpoint[0]))
    assert result.exit_code == 2, result.output  # a refusal like every other (issue 43)
    assert result.stderr == (
        "error: tiktoken is not installed: give the prompt as token ids, e.g. --ids "
        "464,2068,7586, or run offline with the shipped byte-level model: kvcache generate "
        '-m stdlib-bytes "Hello"\n')


def test_cli_text_prompt_for_a_non_gpt2_vocabulary_is_refused(checkpoint, monkeypatch):
    import kvcache_cli.models.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "gpt2_encoding", lambda: (ByteEncoding(), None))
    result = invoke("generate", "hello", "--model", str(checkpoint[0]))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: the model's vocabulary (256) is not GPT-2's")


def test_cli_unknown_model_is_one_line_exit_2():
    result = invoke("generate", "--model", "/no/such/dir", "--ids", "1")
    assert result.exit_code == 2, result.output
    # Every kind --model takes, before torch is imported (issue 43).
    assert result.stderr.startswith("error: model '/no/such/dir': no such file or folder; "
                                    "expected gpt2, ")


def test_cli_gpt2_break_on_a_checkpoint(checkpoint, model):
    path = str(checkpoint[0])
    result = invoke("break", "causal-decode", "--model", path, "--max-new-tokens", "12", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    expected = run_break("causal-decode", model, None, 12)
    assert data["name"] == "causal-decode" and data["first_divergence"] == expected.first_divergence
    assert data["broken"] == list(expected.broken) and data["naive_agrees"] is True
    shown = invoke("break", "causal-decode", "--model", path, "--max-new-tokens", "12")
    assert shown.exit_code == 0, shown.output
    assert f"tokens diverge at step {expected.first_divergence}" in shown.stdout


def test_a_break_recomputes_the_control_in_one_forward_and_reports_every_token(model):
    # The control used to rerun the whole sequence for every token (minutes at 1,000
    # tokens); now the cached loops feed one token per call and the recompute is one call.
    fed: list[int] = []
    forward = model.forward

    def counting(idx, *args, **kwargs):
        fed.append(idx.size(1))
        return forward(idx, *args, **kwargs)

    model.forward = counting
    seen: list[tuple[str, int, int]] = []
    n = 20
    r = run_break("stale-cache", model, PROMPT, n, progress=lambda *a: seen.append(a))
    earlier = len(r.earlier_ids)
    # request 1, then the broken and the correct loop: a prefill and n - 1 single tokens
    # each; then the full recompute over the prompt and n - 1 tokens, once.
    assert fed == ([earlier] + [1] * (n - 1) + [len(PROMPT)] * 2 + [1, 1] * (n - 1)
                   + [len(PROMPT) + n - 1])
    assert [done for _, done, _ in seen] == list(range(1, 3 * n + 1))
    assert {total for _, _, total in seen} == {3 * n}
    assert [label for label, _, _ in seen][:: n] == ["request 1, filling the cache",
                                                     "correct and broken loops",
                                                     "correct and broken loops"]
    assert r.naive_agrees and r.naive_logit_diff < 1e-4


def test_cli_long_break_off_a_terminal_prints_progress_lines(checkpoint):
    result = invoke("break", "stale-cache", "-m", str(checkpoint[0]), "--max-new-tokens", "50")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert "stale-cache: 15/150 tokens" in lines and "stale-cache: 150/150 tokens" in lines
    assert any(line.startswith("stale-cache: request 1, filling the cache, 50 tokens in ")
               for line in lines), lines
    short = invoke("break", "stale-cache", "-m", str(checkpoint[0]), "--max-new-tokens", "20")
    assert short.exit_code == 0 and short.stderr == "", short.output  # a short break is quiet
    assert "GPT-2 break: stale-cache" in result.stdout and "full recompute" in result.stdout


def test_cli_break_all_json_is_one_document_of_every_break(checkpoint):
    result = invoke("break", "all", "--model", str(checkpoint[0]), "--max-new-tokens", "8",
                    "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    from kvcache_cli.breaks.registry import names

    # A GPT-2 checkpoint: the Llama breaks are skipped, in one note line.
    assert list(data) == ["no-mask", "no-append", "cache-q", "overflow", "wrong-cache",
                          *names("gpt2")]
    assert {"no-rollback", "kv-sink-token", "ring-mask"} <= set(names("gpt2"))
    assert result.stderr.count("note:") == 1 and "note: skipped: the Llama breaks" in result.stderr
    assert data["ring-mask"]["budget"] == 8 and data["ring-mask"]["kl_broken"] > 0
    assert data["overflow"]["position"] == 128
    assert all(data[name]["first_divergence"] is not None for name in BREAKS)


def test_generate_help_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvcache_cli.cli import app\n"
        "result = CliRunner().invoke(app, ['generate', '--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
