"""The compiled decode step (`generate.CompiledDecode`): gpt-fast's one graph, for every family.

Compiling even a tiny model takes seconds on 2 cores, so each family compiles once here.
"""

from __future__ import annotations

import pytest
import torch

from kvcache_cli.caches import make_cache
from kvcache_cli.generate import CompiledDecode, stream_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(family: str):
    if family == "gpt2":
        from kvcache_cli.models.gpt2 import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=4,
                             n_embd=32)).eval()
    from kvcache_cli.models.llama import Llama, LlamaConfig, init_random

    if family == "gemma3":
        from gemmakit import random_gemma3

        return random_gemma3(window=8)  # a prompt of 8 and 24 new tokens wrap the rings
    config = LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=48, intermediate=64,
                         vocab_size=96, context=64)
    return init_random(Llama(config), 0.3, 0).eval()


# fp16 on Gemma 3: the global layers' buffers and the rings in float16
@pytest.mark.parametrize(("family", "spec"), [("gpt2", "static"), ("llama", "static"),
                                              ("gemma3", "static"), ("gemma3", "fp16")])
def test_the_compiled_step_makes_the_eager_tokens_compiling_once_for_every_position(family,
                                                                                     spec):
    model = tiny(family)
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 24
    eager = make_cache(spec, model, max_len=len(prompt) + n, batch=1)
    expected = list(stream_tokens(model, prompt, n, spec, cache=eager))

    torch._dynamo.reset()
    step = CompiledDecode(model)
    # One graph: a recompile at any later position (or for a fresh cache of the same
    # size, as every bench repeat makes) raises instead of passing slowly.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            cache = make_cache(spec, model, max_len=len(prompt) + n, batch=1, whole=True)
            got = list(stream_tokens(model, prompt, n, spec, cache=cache, forward=step))
            assert got == expected
            # the bookkeeping done after the graph is what the eager writes recorded
            assert (cache.length, cache.bytes_copied) == (eager.length, eager.bytes_copied)
            for compiled, written in zip(layers(cache), layers(eager)):
                # another order of float32 sums may round to the next stored number
                ulp = torch.finfo(written.k[1].dtype).eps * written.k[1].abs().max().item()
                torch.testing.assert_close(compiled.k[1], written.k[1], rtol=1e-5,
                                           atol=max(1e-5, ulp))
                if hasattr(written, "positions"):  # a ring: each slot holds the same position
                    assert torch.equal(compiled.positions(), written.positions())


def layers(cache):
    """The caches a model's cache is made of: Gemma 3's ring and static one, or itself."""
    return getattr(cache, "caches", [cache])


def test_a_compiled_step_refuses_a_cache_it_cannot_read_whole():
    model = tiny("gpt2")
    step = CompiledDecode(model)
    for cache in (make_cache("static", model, max_len=16, batch=1),  # the filled prefix
                  make_cache("concat", model, max_len=16, batch=1)):
        with pytest.raises(ValueError, match="reads a static cache whole"):
            step(torch.tensor([[1]]), 3, cache)


def test_the_static_cache_refuses_a_write_past_its_slots():
    model = tiny("gpt2")
    cache = make_cache("static", model, max_len=4, batch=1, whole=True)
    with pytest.raises(IndexError, match="past the static cache's 4 slots"):
        cache.advance(3, 2)


def test_a_ring_with_rerotated_sinks_refuses_to_be_built_for_a_compiled_step():
    # its sinks turn by a shift read from a Python position, which a graph cannot hold
    model = tiny("llama")
    with pytest.raises(ValueError, match="drop :rerotate or run eager"):
        make_cache("sink:2+8:rerotate", model, max_len=32, batch=1, whole=True)
    assert make_cache("sink:2+8", model, max_len=32, batch=1, whole=True).whole
