"""bench's bytes a decode step reads on a model with sliding layers: each sliding layer
counts its window at most (the ring it holds), the global ones every position; checked
against what kvcache's hybrid cache holds after the same prefill, on a tiny random Gemma 3."""

import pytest

torch = pytest.importorskip("torch")

from kvcache_cli.bench.summary import kv_bytes_read  # noqa: E402
from kvcache_cli.caches import make_cache  # noqa: E402
from kvcache_cli.caches.spec import parse_cache_spec  # noqa: E402

WINDOW, PROMPT = 8, 30  # the prompt past the window: every sliding layer has evicted


def tiny_gemma3():
    """Four sliding layers of 8, then a global one; one KV head of 16, float32."""
    from transformers import Gemma3TextConfig

    from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config

    hf = Gemma3TextConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=128, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        query_pre_attn_scalar=16, pad_token_id=None, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    return Gemma3(Gemma3Config.from_hf(hf.to_dict())).eval()


@pytest.mark.parametrize("spec", ["static", "window:12"])
def test_a_step_reads_each_sliding_layer_up_to_its_window(spec):
    model = tiny_gemma3()
    cache = make_cache(spec, model, PROMPT)
    with torch.no_grad():
        model(torch.randint(3, 50, (1, PROMPT)), 0, cache, last_only=True)
    shape = model.config.cache_shape
    bounded = None if spec == "static" else parse_cache_spec(spec)
    read = kv_bytes_read(shape, PROMPT, 4, bounded)
    assert read == cache.bytes_held
    per_position = 2 * 1 * 16 * 4  # K and V × one KV head × 16 × float32
    if bounded is None:  # every layer at every position would count 5 × 30 positions
        assert read == per_position * (4 * WINDOW + PROMPT) < 5 * PROMPT * per_position
