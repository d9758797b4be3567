"""The replayed decode step (`generate.ReplayedDecode`): a step's native calls recorded once
and run again, which must decode exactly as the eager step does, or run eager and say why.
"""

from __future__ import annotations

import pytest
import torch

from kvcache_cli.caches import make_cache, native
from kvcache_cli.generate import REPLAY_NOTE, ReplayedDecode, _Recorded, token_steps
from kvcache_cli.models import fused, linear
from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config
from kvcache_cli.models.llama import LayerType, Llama, LlamaConfig, init_random

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(autouse=True)
def kernels():
    if fused.library() is None or linear.products() is None:
        pytest.skip(f"no native kernels here: {(fused.NOTE or linear.NOTE)[-1]}")


def tiny_llama(seed: int = 0) -> Llama:
    model = Llama(LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=192, intermediate=96,
                              vocab_size=96, context=64))
    return linear.arrange_weights(init_random(model, 0.3, seed)).eval()


def steps(model, forward, cache, n: int = 20) -> list[tuple[int, torch.Tensor]]:
    """(token, logits) of each step, the logits copied out."""
    return [(token, logits.clone()) for token, logits in
            token_steps(model, PROMPT, n, "static", cache, lambda x: x.argmax(-1), forward)]



def gemma3(*types: LayerType) -> Gemma3:
    model = Gemma3(Gemma3Config(n_layer=2, n_head=2, n_kv_head=1, n_embd=96, head_dim=64,
                                intermediate=160, vocab_size=96, context=64, layer_types=types,
                                query_pre_attn_scalar=64))
    return linear.arrange_weights(init_random(model, 0.3, 0)).eval()


def gemma3_rings() -> Gemma3:
    """A sliding layer's ring of 6, which the 8-token prompt and 20 new tokens wrap, beside a
    global layer."""
    return gemma3(LayerType(window=6, rope_theta=1e4), LayerType(rope_theta=1e6))


@pytest.mark.parametrize("cache_spec", ["static", "fp16", "bf16"])
@pytest.mark.parametrize(("family", "weights"), [("llama", "fp32"), ("llama", "fp16"),
                                                 ("llama", "int8"), ("gemma3", "fp32")])
def test_replayed_steps_equal_the_eager_steps_bit_for_bit(cache_spec, family, weights):
    model = linear.set_weights_dtype(tiny_llama() if family == "llama" else gemma3_rings(),
                                     weights)
    eager_cache = make_cache(cache_spec, model, len(PROMPT) + 20)
    eager = steps(model, None, eager_cache)
    replayed = ReplayedDecode(model)
    cache = make_cache(cache_spec, model, len(PROMPT) + 20)
    got = steps(model, replayed, cache)
    assert replayed.why_not is None and replayed._plan is not None
    assert [t for t, _ in got] == [t for t, _ in eager]
    for (_, want), (_, have) in zip(eager, got, strict=True):
        assert torch.equal(have, want)  # the same kernels on the same numbers
    for mine, theirs in zip(cache.buffers(), eager_cache.buffers(), strict=True):
        assert torch.equal(mine, theirs)
    assert (cache.length, cache.bytes_copied) == (eager_cache.length, eager_cache.bytes_copied)


def _integer_layers(cache) -> list:
    """The quantised layers of a cache, or of each cache of a hybrid one."""
    return [L for c in getattr(cache, "caches", [cache]) for L in getattr(c, "layers", [])]


# int8's default (each token quantised at once), sinks, per-channel chunks of 8 leaving a
# residual of 4 (the prompt's 8 tokens and 20 steps pass two flushes), a residual of per-token
# groups (a token leaves the tail every step), chunks with no residual; and Gemma 3's global
# layer quantised beside its ring
@pytest.mark.parametrize(("family", "spec"), [
    ("llama", "int8"), ("llama", "int8:s2"), ("llama", "int4:g8:kchan:r4"),
    ("llama", "int2:g8:ktok:r3:s1"), ("llama", "int4:g16:kchan:r0"), ("gemma3", "int4:g8:kchan:r4"),
    ("gemma3", "int8")])
def test_replayed_integer_caches_equal_their_eager_steps_bit_for_bit(family, spec):
    model = tiny_llama() if family == "llama" else gemma3_rings()
    eager_cache = make_cache(spec, model, len(PROMPT) + 20)
    eager = steps(model, None, eager_cache)
    replayed = ReplayedDecode(model)
    cache = make_cache(spec, model, len(PROMPT) + 20)
    got = steps(model, replayed, cache)
    assert replayed.why_not is None and replayed.steps_replayed >= 16
    assert [t for t, _ in got] == [t for t, _ in eager]
    for (_, want), (_, have) in zip(eager, got, strict=True):
        assert torch.equal(have, want)
    for mine, theirs in zip(_integer_layers(cache), _integer_layers(eager_cache), strict=True):
        for a, b in zip(mine.tensors(), theirs.tensors(), strict=True):  # what each holds
            assert torch.equal(a, b)
    assert (cache.length, cache.bytes_copied) == (eager_cache.length, eager_cache.bytes_copied)


def test_a_replayed_integer_cache_reads_its_tail_where_a_prefill_gave_it_back():
    # a second prompt after a reset: the tail's buffer, grown by the prefill and given back,
    # is a new one of the same shape, which the plan's calls then point at
    model = tiny_llama(2)
    replayed = ReplayedDecode(model)
    cache = make_cache("int4:g8:kchan:r4", model, 64)
    first = steps(model, replayed, cache)
    plan = replayed._plan
    cache.reset()
    again = steps(model, replayed, cache)
    assert replayed._plan is plan and replayed.steps_replayed > 30
    assert [t for t, _ in again] == [t for t, _ in first]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, first, strict=True))


def test_a_crop_keeps_the_integer_buffers_a_plan_points_at():
    # bench crops back to its context after each round: the plan's calls then point at the
    # same memory, and are not made again
    model = tiny_llama()
    replayed = ReplayedDecode(model)
    cache = make_cache("int8:s2", model, 64)
    steps(model, replayed, cache, n=8)
    plan, held, calls = replayed._plan, cache.buffers(), replayed._plan.calls
    cache.crop(cache.length - 3)
    assert all(a is b for a, b in zip(cache.buffers(), held, strict=True))
    with torch.inference_mode():  # as the steps ran
        replayed(torch.tensor([[7]]), cache.length, cache, last_only=True)
    assert replayed._plan is plan and plan.calls is calls  # not resolved again


def test_one_plan_serves_a_fresh_cache_and_every_earlier_logits_stay_as_they_were():
    model = tiny_llama(1)
    replayed = ReplayedDecode(model)
    first = steps(model, replayed, make_cache("static", model, len(PROMPT) + 20))
    kept = [logits.clone() for _, logits in first]
    plan = replayed._plan
    second = steps(model, replayed, make_cache("static", model, len(PROMPT) + 20))
    assert replayed._plan is plan  # recorded once, resolved for the new cache
    assert [t for t, _ in second] == [t for t, _ in first]
    assert all(torch.equal(a, b) for (_, a), b in zip(first, kept, strict=True))


def test_a_replayed_step_past_the_last_slot_is_refused_as_the_eager_step_is():
    model = tiny_llama()
    replayed = ReplayedDecode(model)
    cache = make_cache("static", model, len(PROMPT) + 4)
    steps(model, replayed, cache, n=5)  # four decode steps: two recorded, two replayed
    before = [t.clone() for t in cache.buffers()]
    with pytest.raises(IndexError, match="past the static cache's 12 slots"):
        replayed(torch.tensor([[7]]), len(PROMPT) + 4, cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.buffers(), before, strict=True))
    with pytest.raises(IndexError, match="past context window 64"):
        replayed(torch.tensor([[7]]), 64, cache)



@pytest.mark.parametrize(("spec", "why"), [
    ("int8:rot", "a QuantizedCache has no fixed buffers"),  # its query turned in torch
    ("concat", "a ConcatCache has no fixed buffers"),
    ("sink:2+6", "a RingCache has no fixed buffers"),  # its sinks: not a plain window
])
def test_a_step_that_is_not_native_calls_alone_runs_eager_and_says_why(spec, why):
    model = tiny_llama()
    REPLAY_NOTE.clear()
    eager = steps(model, None, make_cache(spec, model, len(PROMPT) + 20))
    replayed = ReplayedDecode(model)
    got = steps(model, replayed, make_cache(spec, model, len(PROMPT) + 20))
    assert [t for t, _ in got] == [t for t, _ in eager]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, eager, strict=True))
    assert replayed._plan is None
    assert why in replayed.why_not and REPLAY_NOTE == [f"decode steps not replayed: "
                                                       f"{replayed.why_not}"]


def test_a_torch_op_in_the_step_is_named_and_the_step_runs_eager(monkeypatch):
    model = gemma3_rings()
    monkeypatch.setattr(fused, "scale", lambda x, s: x * s)  # the embedding scale in torch
    eager = steps(model, None, make_cache("static", model, len(PROMPT) + 20))
    replayed = ReplayedDecode(model)
    got = steps(model, replayed, make_cache("static", model, len(PROMPT) + 20))
    assert [t for t, _ in got] == [t for t, _ in eager]
    assert replayed._plan is None and "aten.mul" in replayed.why_not


def test_a_first_step_that_makes_a_memo_is_recorded_again_and_then_replayed(monkeypatch):
    """A model's first forward may make what later ones reuse with a torch op (Gemma 3's
    embedding scale, made once): a decode with no prefill before it is still replayed."""
    from kvcache_cli.models import gemma3 as gemma3_module

    model = gemma3_rings()
    monkeypatch.setattr(gemma3_module, "_SCALES", {})
    replayed = ReplayedDecode(model)
    cache, eager_cache = (make_cache("static", model, 8) for _ in range(2))
    with torch.inference_mode():
        for pos, token in enumerate([3, 1, 4, 1, 5]):
            got = replayed(torch.tensor([[token]]), pos, cache)
            assert torch.equal(got, model(torch.tensor([[token]]), pos, eager_cache))
    assert replayed.why_not is None and replayed.steps_replayed == 2


def test_two_steps_whose_calls_differ_by_a_number_are_not_replayed():
    model = tiny_llama()
    calls = []
    cache = make_cache("static", model, 16)
    with native.recorded(calls):
        steps(model, None, cache, n=3)
    assert {f.__name__ for f, _ in calls} == {"rms_norm", "product_f32", "qk_rotary",
                                              "attend_decode", "add_rms_norm", "glu"}
    function, args = calls[0]

    def recorded(number):
        return _Recorded([(function, args)], ["op"], [], None, torch.zeros(1), None,
                         [(*args[:-1], number)])
    assert recorded(5).differs(recorded(5)) is None
    assert "different arguments" in recorded(5).differs(recorded(6))


def test_recording_hands_every_library_function_back():
    lib = fused.library()
    before = {name: f for name, f in vars(lib).items() if isinstance(f, lib._FuncPtr)}
    calls = []
    with pytest.raises(RuntimeError), native.recorded(calls):
        assert not isinstance(lib.rms_norm, lib._FuncPtr)
        raise RuntimeError
    assert {name: getattr(lib, name) for name in before} == before


def test_the_residual_add_is_torchs_add():
    x, delta = torch.randn(3, 1, 37), torch.randn(3, 1, 37)
    assert torch.equal(fused.add(x, delta), x + delta)


def test_the_embedding_scale_is_torchs_product():
    x = torch.randn(2, 1, 640)
    s = 640 ** 0.5
    assert torch.equal(fused.scale(x, s), x * s)


def test_generate_replays_its_decode_steps_where_it_can_and_says_so():
    from kvcache_cli.generate import generate

    model = tiny_llama()
    for spec, replays in (("static", True), ("fp16", True), ("int8", True), ("naive", False),
                          ("concat", False)):
        got = generate(model, PROMPT, 20, spec)
        # 19 decode steps: two recorded (three where the first built a kernel), the rest
        # replayed
        assert got.steps_replayed in ((17, 16) if replays else (0,)), spec
        want = [t for t, _ in token_steps(model, PROMPT, 20, spec,
                                           make_cache(spec, model, len(PROMPT) + 20),
                                           lambda x: x.argmax(-1))]
        assert list(got.tokens) == want
    # sinks of 10, filled by the 8-token prompt and the first two decode steps (eager): the
    # steps after them replayed
    got = generate(model, PROMPT, 20, "int8:s10")
    assert got.steps_replayed in (15, 14)
    assert list(got.tokens) == [t for t, _ in token_steps(
        model, PROMPT, 20, "int8:s10", make_cache("int8:s10", model, len(PROMPT) + 20),
        lambda x: x.argmax(-1))]


def test_bench_times_the_replayed_mode_beside_static_and_says_when_it_ran_eager():
    from kvcache_cli.bench import run as bench_run
    from kvcache_cli.models.gpt2 import GPT, GPTConfig

    options = dict(modes=("static", "static-replayed"), prompt_len=8, new_tokens=12,
                   repeats=1, bandwidth_mib=4)
    REPLAY_NOTE.clear()
    result = bench_run.run_bench(tiny_llama(), **options)
    replayed = result.mode("static-replayed")
    assert replayed.same_tokens and replayed.tokens == result.mode("static").tokens
    assert "decode steps not replayed" not in (result.kernel_note or "")
    torch.manual_seed(0)
    gpt2 = GPT(GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=4, n_embd=32)).eval()
    result = bench_run.run_bench(gpt2, **options)  # its blocks are torch ops: eager
    assert result.mode("static-replayed").same_tokens
    assert "decode steps not replayed: the step runs torch's" in result.kernel_note


def test_recording_a_step_imports_no_compiler():
    # torch wraps a dispatch mode's __torch_dispatch__ in its dynamo guard, whose first call
    # imports torch._dynamo: seconds inside a one-shot `generate`'s first decode step
    import subprocess
    import sys

    script = """
import sys
from kvcache_cli.generate import generate
from kvcache_cli.models import linear
from kvcache_cli.models.llama import Llama, LlamaConfig, init_random
model = Llama(LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=192, intermediate=96,
                          vocab_size=96, context=64))
model = linear.arrange_weights(init_random(model, 0.3, 0)).eval()
assert generate(model, [3, 1, 4], 8, "static").steps_replayed > 0
print("torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
