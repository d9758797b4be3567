"""`--engine transformers` (`hf.engine`): kvcache's own loops run a transformers model with
the bridge's caches. On SmolLM2 and Gemma 3, eval through transformers equals eval through
kvcache's own model for every kind the bridge holds; on tiny random checkpoints of
architectures kvcache has no family for (Qwen3, Mistral with its sliding window, Phi-3),
generate, eval and bench run through the CLI, and what the engine cannot run is refused in
one line."""

from __future__ import annotations

import json
import re

import pytest
from cachekinds import example_spec
from llamakit import smollm2_or_skip
from typer.testing import CliRunner

from kvcache_cli.caches.spec import KINDS
from kvcache_cli.cli import app

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from kvcache_cli.hf import BRIDGE_KINDS  # noqa: E402 - after the skip: it loads transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
VOCAB = 256  # the tiny checkpoints' tokenizer: one token per byte


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "100"})


def _tiny(folder, config) -> str:
    """A random transformers checkpoint of `config`, with a byte-level tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 stand-ins, one per byte
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Checkpoints of three architectures kvcache has no family for, heads 32 wide (every
    quantised kind's default groups divide them); Mistral's every layer slides (window 8)."""
    from transformers import MistralConfig, Phi3Config, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)
    configs = {"qwen3": Qwen3Config(head_dim=32, **shape),
               "mistral": MistralConfig(head_dim=32, sliding_window=8, **shape),
               "phi3": Phi3Config(pad_token_id=0, **shape)}
    root = tmp_path_factory.mktemp("tiny-hf")
    return {name: _tiny(root / name, config) for name, config in configs.items()}


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "phi3"])
def test_generate_picks_transformers_and_decodes_as_transformers_does(tiny, arch):
    from transformers import AutoModelForCausalLM

    out = invoke("generate", "-m", tiny[arch], "--ids", "5,6,7,8,9", "-n", "6",
                 "--cache", "int8", "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got["model"].startswith("transformers ") and got["cache_bytes_held"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny[arch]).eval()
    want = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=6, do_sample=False)
    # int8 keys and values within a random model's margins: transformers' own tokens.
    assert list(got["tokens"]) == want[0, 5:].tolist()


def test_eval_scores_the_bridge_kinds_on_a_model_without_a_family(tiny):
    out = invoke("eval", "-m", tiny["qwen3"], "--tokens", "48", "--prompt-len", "16",
                 "--cache", "int8,int2:r0", "--json")
    assert out.exit_code == 0, out.output
    rows = {row["cache"]: row for row in json.loads(out.stdout)["caches"]}
    assert rows["static"]["kl_mean"] == 0 and rows["static"]["positions"] == 47
    assert 0 < rows["int2:g32:kchan:r0"]["kl_mean"]  # its codes hold every position
    assert rows["int8:g32:ktok:r0"]["bytes_held"] < rows["static"]["bytes_held"]


def test_bench_times_the_loop_on_a_sliding_window_model(tiny):
    out = invoke("bench", "-m", tiny["mistral"], "--cache", "int4", "--prompt-len", "12",
                 "--new-tokens", "6", "--repeats", "1", "--json")
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert [m["mode"] for m in result["modes"]] == ["static", "int4:g32:kchan:r128"]
    assert result["tokens_agree"]


def test_kvcache_engine_on_an_architecture_it_has_no_family_for_is_refused(tiny):
    out = invoke("eval", "-m", tiny["phi3"], "--engine", "kvcache")
    assert out.exit_code == 2
    assert out.output.strip() == (f"error: model {tiny['phi3']!r} is a Phi3ForCausalLM: "
                                  "kvcache has no family for it (gpt2, llama, gemma3); "
                                  "--engine transformers runs it")


def test_a_kind_the_bridge_does_not_hold_is_refused_by_name(tiny):
    kind = next((k for k in KINDS if k not in BRIDGE_KINDS), None)
    if kind is None:
        pytest.skip("the bridge holds every kind")
    spec = example_spec(kind, 16)
    out = invoke("generate", "-m", tiny["qwen3"], "--ids", "1,2,3", "--cache", spec)
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1
    assert "the transformers engine holds" in out.output and ", ".join(BRIDGE_KINDS) in out.output


@pytest.mark.parametrize("args", [
    ["bench", "--modes", "hf"], ["bench", "--context", "64"], ["generate", "--draft", "lookup"],
    ["eval", "--task", "retrieval"],
])
def test_what_the_transformers_engine_does_not_run_is_refused_in_one_line(tiny, args):
    extra = ["--ids", "1,2,3"] if args[0] == "generate" else []
    out = invoke(args[0], "-m", tiny["qwen3"], *args[1:], *extra)
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert "transformers" in out.output


def test_a_hub_id_not_in_the_local_cache_is_refused_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = invoke("generate", "-m", "nobody/no-such-model", "--ids", "1,2,3")
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert "nobody/no-such-model" in out.output


def test_kvcache_models_keep_their_engine():
    from kvcache_cli.cli.engine import Engine, pick_engine

    for name in ("gpt2", "stdlib-bytes", "smollm2", "gemma3", "no-such-model"):
        assert pick_engine(name, Engine.auto) == "kvcache", name


def test_a_gemma3_gguf_path_is_kvcaches_own(tmp_path):
    import gemmakit

    from kvcache_cli.cli.engine import Engine, pick_engine

    path = gemmakit.write_tiny_gemma3(tmp_path / "tiny.gguf")
    assert pick_engine(str(path), Engine.auto) == "kvcache"
    assert pick_engine(str(path), Engine.kvcache) == "kvcache"  # not refused as foreign


@pytest.mark.parametrize("engine", ["kvcache", "transformers"])
def test_gemma3_in_float16_is_refused_not_run_to_nan_logits(tmp_path, engine):
    import gemmakit

    path = gemmakit.write_tiny_gemma3(tmp_path / "tiny.gguf")
    out = invoke("generate", "-m", str(path), "--engine", engine, "--dtype", "fp16",
                 "--ids", "1,2", "-n", "2")
    assert out.exit_code == 2, out.output
    assert out.stderr.strip().splitlines() == [
        "error: --dtype fp16: Gemma 3's activations pass float16's largest number (65,504) "
        "and every logit comes out NaN (transformers' Gemma3ForCausalLM too); expected "
        "--dtype bf16 or fp32"]


# ---------------------------------------------------------------------------- SmolLM2


def _quantising(kind: str) -> str:
    """The kind's example spec with no full-precision residual: on a short text every
    position past the prompt is then held as the kind holds it."""
    return re.sub(r":r\d+", ":r0", example_spec(kind, 32))


SPECS = [_quantising(kind) for kind in BRIDGE_KINDS]
SCORED = 16  # tokens scored after a prompt of 64: SmolLM2 runs each step once per cache


def _evals(model: str) -> dict[str, dict[str, dict]]:
    """`eval --json` of every bridge kind on `model` through each engine, by cache."""
    runs = {}
    for engine in ("kvcache", "transformers"):
        out = invoke("eval", "-m", model, "--engine", engine, "--tokens", str(64 + SCORED),
                     "--prompt-len", "64", "--cache", ",".join(SPECS), "--json")
        assert out.exit_code == 0, out.output
        runs[engine] = {row["cache"]: row for row in json.loads(out.stdout)["caches"]}
    return runs


@pytest.fixture(scope="module")
def smollm2_evals(tmp_path_factory):
    """SmolLM2 written as a transformers folder: the same float32 weights and tokenizer.json
    for both engines."""
    smollm2_or_skip()
    from kvcache_cli.models.gguf.hf_export import write_hf_folder
    from kvcache_cli.models.llama_loading import _gguf_folder

    real, _ = _gguf_folder("smollm2")
    folder = tmp_path_factory.mktemp("smollm2") / real.name
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).symlink_to(real / name)
    return _evals(str(write_hf_folder(folder).path))


@pytest.fixture(scope="module")
def gemma3_evals():
    """Gemma 3's GGUF, which transformers dequantises as kvcache does (its sliding layers in
    each engine's window), and tokenizes the same."""
    from gemmakit import gemma3_or_skip

    gemma3_or_skip()
    return _evals("gemma3")


def _assert_same_eval(evals, spec: str) -> None:
    from kvcache_cli.caches.spec import parse_cache_spec

    parsed = parse_cache_spec(spec)
    ours, theirs = (evals[e][str(parsed)] for e in ("kvcache", "transformers"))
    assert (theirs["bytes_held"], theirs["positions"]) == (ours["bytes_held"], ours["positions"])
    if parsed.info.exact:
        # Two float32 implementations of one function: sums in another order, ~1e-6 apart.
        assert theirs["perplexity"] == pytest.approx(ours["perplexity"], rel=1e-5)
        assert theirs["kl_mean"] == pytest.approx(ours["kl_mean"], abs=1e-6)
        assert theirs["top1_agreement"] == ours["top1_agreement"]
        return
    # A quantiser turns keys 1e-6 apart into codes one step apart now and then: weights
    # scaled by 1 + 1e-6 noise move kvcache's own int4 perplexity by 0.8% and its KL by
    # 4% (measured on SmolLM2, 16 scored tokens); the engines differ by less.
    assert theirs["perplexity"] == pytest.approx(ours["perplexity"], rel=2e-2)
    assert theirs["kl_mean"] == pytest.approx(ours["kl_mean"], rel=0.2, abs=1e-5)
    assert theirs["top1_agreement"] == pytest.approx(ours["top1_agreement"], abs=2 / SCORED)


@pytest.mark.parametrize("spec", SPECS)
def test_smollm2_eval_through_transformers_equals_kvcache_own(smollm2_evals, spec):
    _assert_same_eval(smollm2_evals, spec)


@pytest.mark.parametrize("spec", SPECS)
def test_gemma3_eval_through_transformers_equals_kvcache_own(gemma3_evals, spec):
    _assert_same_eval(gemma3_evals, spec)


def test_smollm2_gguf_through_transformers_decodes_kvcache_own_tokens():
    smollm2_or_skip()
    ids = "1,9690,198,2683,359,253,5356,5646,2"
    runs = [invoke("generate", "-m", "smollm2", "--engine", engine, "--ids", ids, "-n", "6",
                   "--json") for engine in ("kvcache", "transformers")]
    assert [r.exit_code for r in runs] == [0, 0], runs[1].output
    ours, theirs = (json.loads(r.stdout) for r in runs)
    assert theirs["model"].startswith("transformers ") and theirs["model"].endswith(".gguf)")
    # transformers dequantises the same GGUF blocks kvcache reads: the same greedy tokens.
    assert theirs["tokens"] == ours["tokens"]


def test_q4_on_a_gemma3_gguf_names_the_blocks_it_cannot_take(tmp_path):
    import gemmakit

    path = gemmakit.write_tiny_gemma3(tmp_path / "tiny.gguf", types={"attn_output": "Q6_K"})
    out = invoke("generate", "-m", str(path), "--weights-dtype", "q4", "--ids", "1,2", "-n", "1")
    assert out.exit_code == 2, out.output
    line = out.stderr.strip()
    assert line.startswith("error: --weights-dtype: q4 runs Q4_0, Q4_1, Q8_0 blocks"), line
    assert ".weight is Q6_K in tiny.gguf" in line, line  # its blocks read, not "no GGUF"
