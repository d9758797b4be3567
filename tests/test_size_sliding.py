"""`kvcache size --cache SPEC` on models with sliding-window layers: the spec on the global
layers, the sliding ones in exact rings of their window (`--sliding model`; a half kind's
rings in its 2 bytes too), or the spec on every layer (`--sliding full`, the waste); bytes
per layer kind, checked against what kvcache's own hybrid cache holds after a prompt three
windows long."""

import json

import pytest
from typer.testing import CliRunner

from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.cli import app
from kvcache_cli.sizing import resolve_shape
from kvcache_cli.sizing.cache_spec import size_spec

runner = CliRunner()
PROMPT, WINDOW = 1_500, 512


def size_json(*args: str) -> dict:
    out = runner.invoke(app, ["size", *args, "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_the_spec_holds_the_global_layers_and_the_sliding_ones_hold_their_window():
    shape = resolve_shape("gemma-3-270m")[0]  # 15 sliding layers of 512, 3 global; 1 KV head
    r = size_spec(shape, parse_cache_spec("static"), 32_768, dtype="fp16")
    per_token = 2 * 1 * 256 * 2  # K and V × one KV head × 256 × fp16, one layer
    kinds = {k: (n, b) for k, n, b in r.bytes_by_kind}
    assert kinds == {"full": (3, 3 * 32_768 * per_token),
                     "sliding": (15, 15 * WINDOW * per_token)}
    assert r.spec_layers == 3
    # --sliding full: every layer holds every position, the waste the other figure names.
    assert r.other_sliding_bytes == 18 * 32_768 * per_token
    full = size_spec(shape, parse_cache_spec("static"), 32_768, dtype="fp16", sliding="full")
    assert (full.spec_layers, full.bytes_per_sequence) == (18, r.other_sliding_bytes)
    assert full.other_sliding_bytes == r.bytes_per_sequence


def test_size_says_which_layers_the_spec_holds_and_what_sliding_full_wastes():
    out = runner.invoke(app, ["size", "-m", "gemma-3-270m", "--cache", "int8", "--seq",
                              "32k"], env={"COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    assert "full: 3 layers, the spec:" in out.output
    assert "sliding: 15 layers, exact rings of their window at fp16:" in out.output
    assert "--sliding full (the spec on every layer too):" in out.output
    wasteful = size_json("-m", "gemma-3-270m", "--cache", "int8", "--seq", "32k",
                         "--sliding", "full")
    exact = size_json("-m", "gemma-3-270m", "--cache", "int8", "--seq", "32k")
    assert wasteful["bytes_per_sequence"] == exact["other_sliding_bytes"]
    assert wasteful["bytes_per_sequence"] > 4 * exact["bytes_per_sequence"]


def test_an_all_sliding_model_holds_the_spec_on_no_layer_unless_sliding_full():
    r = size_json("-m", "mistral-7b", "--cache", "int4", "--seq", "32k")
    assert r["spec_layers"] == 0 and r["payload_bytes"] == 0
    assert any("--sliding full" in n for n in r["notes"])
    assert size_json("-m", "mistral-7b", "--cache", "int4", "--seq", "32k", "--sliding",
                     "full")["spec_layers"] == 32


@pytest.mark.parametrize("args, says", [
    (["-m", "gemma3", "--seq", "4k", "--sliding", "full"], "expected --cache SPEC"),
    (["-m", "llama-3-8b", "--cache", "int4", "--sliding", "full"], "no sliding-window"),
    (["-m", "gemma3", "--cache", "int8", "--sliding", "half"], "expected one of model, full"),
])
def test_a_bad_sliding_is_one_line_and_exit_2(args, says):
    out = runner.invoke(app, ["size", *args])
    assert out.exit_code == 2 and says in out.output
    assert out.output.count("\n") == 1


@pytest.mark.parametrize("kind", ["int8", "fp16", "bf16"])  # a half kind's rings: 2 bytes too
@pytest.mark.parametrize("sliding", ["model", "full"])
def test_size_per_kind_is_what_the_hybrid_cache_holds_after_1500_tokens(tmp_path, sliding,
                                                                         kind):
    torch = pytest.importorskip("torch")
    from kvcache_cli.caches import make_cache
    from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config
    from tests.test_gemma3_size import tiny_hf

    hf = tiny_hf()
    path = tmp_path / "config.json"
    hf.config.to_json_file(path)
    r = size_json("--config", str(path), "--cache", kind, "--seq", str(PROMPT), "--dtype",
                  "fp32", "--sliding", sliding)
    model = Gemma3(Gemma3Config.from_hf(hf.config.to_dict())).eval()
    cache = make_cache(kind, model, PROMPT, sliding=sliding)
    ids = torch.randint(3, 101, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, 0, cache, last_only=True)
    assert cache.bytes_by_kind() == {k: b for k, _, b in r["bytes_by_kind"]}
