"""bench's bytes a decode step reads on a model with sliding layers: each sliding layer
counts its window at most (the ring it holds), the global ones every position; checked
against what kvcache's hybrid cache holds after the same prefill, on a tiny random Gemma 3."""

import pytest

torch = pytest.importorskip("torch")

from kvcache_cli.bench.summary import kv_bytes_read  # noqa: E402
from kvcache_cli.caches import make_cache  # noqa: E402
from kvcache_cli.caches.spec import parse_cache_spec  # noqa: E402

WINDOW, PROMPT = 8, 30  # the prompt past the window: every sliding layer has evicted


def tiny_gemma3(sliding: int = 4):
    """`sliding` sliding layers of 8, then a global one; one KV head of 16, float32."""
    from transformers import Gemma3TextConfig

    from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config

    hf = Gemma3TextConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=sliding + 1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=512, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * sliding + ["full_attention"],
        query_pre_attn_scalar=16, pad_token_id=None, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    return Gemma3(Gemma3Config.from_hf(hf.to_dict())).eval()


@pytest.mark.parametrize("spec", ["static", "window:12", "fp16"])  # fp16: 2-byte rings too
def test_a_step_reads_each_sliding_layer_up_to_its_window(spec):
    model = tiny_gemma3()
    cache = make_cache(spec, model, PROMPT)
    with torch.no_grad():
        model(torch.randint(3, 50, (1, PROMPT)), 0, cache, last_only=True)
    shape = model.config.cache_shape
    bounded = None if spec == "static" else parse_cache_spec(spec)  # or fp16's
    read = kv_bytes_read(shape, PROMPT, 4, bounded)
    assert read == cache.bytes_held
    per_position = 2 * 1 * 16 * 4  # K and V × one KV head × 16 × float32
    if bounded is None:  # every layer at every position would count 5 × 30 positions
        assert read == per_position * (4 * WINDOW + PROMPT) < 5 * PROMPT * per_position


def test_bench_context_counts_each_sliding_layer_at_its_window_for_both_engines():
    """`bench --context` past the window: our cache bytes and llama.cpp's count the five
    sliding layers at 8 positions and the global one at every position, not all six at
    the full context. Five sliding layers and a global one: llama.cpp's Gemma 3 pattern."""
    from kvcache_cli.bench import context as bench_context
    from kvcache_cli.caches.spec import layer_bytes, parse_cache_list
    from kvcache_cli.models.llama_cpp import llama_available

    model = tiny_gemma3(sliding=5)
    contexts = [6, PROMPT]
    def run(caches: str, with_llama: bool):
        return bench_context.run_context(model, parse_cache_list(caches), contexts, steps=2,
                                         repeats=1, threads=1, model_name="tiny",
                                         weights="fp32", with_llama=with_llama)

    r = run("static,int8:g16", False)
    per_position = 2 * 1 * 16 * 4  # K and V × one KV head × 16 × float32
    static, int8 = (r.of("kvcache", name).points for name in ("static", "int8:g16:ktok:r0"))
    assert [p.cache_bytes for p in static] == [6 * 6 * per_position,
                                               (5 * WINDOW + PROMPT) * per_position]
    int8_global = layer_bytes(parse_cache_spec("int8:g16"), PROMPT, 1, 16, 4)
    assert int8[1].cache_bytes == 5 * WINDOW * per_position + int8_global  # rings stay fp32
    if llama_available():  # static alone: q8_0's blocks of 32 do not fit heads of 16
        f16 = run("static", True).of("llama.cpp", "f16").points
        assert [p.cache_bytes for p in f16] == [6 * 6 * per_position // 2,
                                                (5 * WINDOW + PROMPT) * per_position // 2]
