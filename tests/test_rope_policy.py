"""Rotary positions in the bounded caches: `:text` (a kept key keeps its position in the
text) and `:rerotate` (StreamingLLM: its place among the keys the query attends).

Checked at the cache, with a small RoPE of the test's own (the half-split layout of
transformers' Llama), against attention written out here from unrotated q and k: under
`text` every key rotated at its text position, under `rerotate` the attended keys
numbered 0, 1, ... and the query after them, as StreamingLLM defines it.
"""

import math

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.bounded import HeavyHitterCache, RingCache
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig
from kvcache_cli.models.llama import Llama, LlamaAttention, LlamaConfig, init_random

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NKV, HS, N = 2, 8, 40
# float64: the cache and the reference rotate and sum the same numbers in another order.
EXACT = 1e-12


class HalfSplitRope:
    """RoPE as transformers' Llama applies it: channel i paired with i + hs/2, rotated by
    position * theta^(-2i/hs); a base of 100 turns the slow channels visibly in 40 steps."""

    def __init__(self, theta: float = 100.0):
        self.theta = theta

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hs = x.size(-1)
        inv = self.theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # (hs/2,)
        angle = positions.to(torch.float64)[..., None] * inv  # (..., hs/2)
        cos, sin = angle.cos(), angle.sin()
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # (..., hs)
        x1, x2 = x[..., : hs // 2], x[..., hs // 2:]
        return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


ROPE = HalfSplitRope()
SHAPE = CacheShape(n_layer=1, n_kv_head=NKV, head_size=HS, context=64, rope=ROPE)


def raw(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unrotated q, k and v (1, nkv, N, hs), float64."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, NKV, N, HS, generator=g, dtype=torch.float64) for _ in range(3))


def build(text: str):
    spec = parse_cache_spec(text)
    cls = HeavyHitterCache if spec.kind == "h2o" else RingCache
    return cls.build(spec, SHAPE, max_len=N, batch=1, device="cpu", dtype=torch.float64,
                     whole=False)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, nkv, T, hs) over keys (1, nkv, S, hs) where visible (.., T, S): (y, weights)."""
    scores = q @ keys.transpose(-2, -1) / math.sqrt(HS)  # (1, nkv, T, S)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return weights @ values, weights


def through_cache(text: str, prompt: int = 6) -> torch.Tensor:
    """Each query's attention output (1, nkv, N, hs): a prompt chunk, then one token a
    step, q and k rotated at their text positions before `update`, as a Llama does."""
    q, k, v = raw()
    pos = torch.arange(N)
    q, k = ROPE.rotate(q, pos), ROPE.rotate(k, pos)
    cache, out = build(text), []
    for start, end in [(0, prompt)] + [(p, p + 1) for p in range(prompt, N)]:
        keys, values = cache.update(0, start, k[:, :, start:end], v[:, :, start:end])
        held = cache.key_positions(0)
        held = held if held.dim() == 3 else held[None, None]  # (1|B, 1|nkv, S)
        query = torch.arange(start, end)[:, None]  # (T, 1)
        seen = held[:, :, None, :]  # (.., 1, S)
        visible = (seen >= 0) & (seen <= query)
        if cache.window is not None:
            visible &= (seen > query - cache.window) | (seen < cache.sinks)
        y, weights = attend(q[:, :, start:end], keys, values, visible)
        if cache.wants_attention:
            cache.observe(0, weights)
        out.append(y)
    return torch.cat(out, dim=2)


def ring_reference(sinks: int, window: int, policy: str) -> torch.Tensor:
    """Each query's output (1, nkv, N, hs) computed from the definition: query p attends
    positions 0..S-1 and max(S, p-W+1)..p, rotated at those positions (text) or at their
    places 0, 1, ... (cache), the query at its own place (the last)."""
    q, k, v = raw()
    out = []
    for p in range(N):
        seen = sorted({*range(min(sinks, p + 1)), *range(max(sinks, p - window + 1), p + 1)})
        at = torch.tensor(seen) if policy == "text" else torch.arange(len(seen))
        keys = ROPE.rotate(k[:, :, seen], at)
        query = ROPE.rotate(q[:, :, p:p + 1], at[-1:])
        y, _ = attend(query, keys, v[:, :, seen], torch.ones(1, 1, 1, len(seen), dtype=bool))
        out.append(y)
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("sinks, window", [(2, 8), (4, 12), (1, 30)])
def test_a_ring_under_either_policy_matches_its_definition(sinks, window):
    text = through_cache(f"sink:{sinks}+{window}")
    moved = through_cache(f"sink:{sinks}+{window}:rerotate")
    torch.testing.assert_close(text, ring_reference(sinks, window, "text"), rtol=0, atol=EXACT)
    torch.testing.assert_close(moved, ring_reference(sinks, window, "cache"), rtol=0,
                               atol=EXACT)
    past = sinks + window  # the first query whose sinks have moved
    assert torch.equal(text[:, :, :past], moved[:, :, :past])  # nothing evicted yet
    assert (text[:, :, past:] - moved[:, :, past:]).abs().max() > 1e-3  # then they differ


def test_a_window_without_sinks_is_the_same_under_either_policy():
    # Every window key and the query share one shift: relative positions do not change.
    assert torch.equal(through_cache("window:8:rerotate"), through_cache("window:8"))


def test_rerotate_moves_what_update_returns_never_what_the_cache_holds():
    cache = build("sink:2+4:rerotate")
    _, k, v = raw()
    for p in range(12):
        keys, _ = cache.update(0, p, k[:, :, p:p + 1], v[:, :, p:p + 1])
    assert torch.equal(cache.k[0][:, :, :2], k[:, :, :2])  # the sinks as written
    assert not torch.equal(keys[:, :, :2], k[:, :, :2])  # and read rotated by the shift
    torch.testing.assert_close(keys[:, :, :2], ROPE.rotate(k[:, :, :2], torch.tensor(11 - 5)),
                               rtol=0, atol=EXACT)


def by_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, held: torch.Tensor, p: int
             ) -> torch.Tensor:
    """The query at p over the positions each head holds (held (1, nkv, S)), from the
    definition: those keys at their places 0, 1, ... in text order, the query last."""
    rows = []
    for h in range(NKV):
        seen = sorted(held[0, h].tolist())
        at = torch.arange(len(seen))
        key = ROPE.rotate(k[:, h:h + 1, seen], at)  # (1, 1, S, hs)
        query = ROPE.rotate(q[:, h:h + 1, p:p + 1], at[-1:])
        rows.append(attend(query, key, v[:, h:h + 1, seen],
                           torch.ones(1, 1, 1, len(seen), dtype=torch.bool))[0])
    return torch.cat(rows, dim=1)  # (1, nkv, 1, hs)


def test_h2o_under_rerotate_numbers_each_heads_kept_keys_by_place():
    q, k, v = raw()
    pos = torch.arange(N)
    qt, kt = ROPE.rotate(q, pos), ROPE.rotate(k, pos)
    cache = build("h2o:4+4:rerotate")
    for p in range(N):  # one token a step: H2O's policy exactly
        keys, values = cache.update(0, p, kt[:, :, p:p + 1], v[:, :, p:p + 1])
        held = cache.key_positions(0)  # (1, nkv, S): each head keeps its own
        y, weights = attend(qt[:, :, p:p + 1], keys, values, (held >= 0)[:, :, None])
        cache.observe(0, weights)  # what it drew under its own positions ranks the keys
        torch.testing.assert_close(y, by_place(q, k, v, held, p), rtol=0, atol=EXACT)
    kept = held[0].sort(dim=-1).values  # (nkv, 8) of 40 positions
    assert not torch.equal(kept[0], kept[1])  # the heads chose apart
    assert (through_cache("h2o:4+4:rerotate") - through_cache("h2o:4+4")).abs().max() > 1e-3


def test_h2o_chunks_after_evictions_number_the_kept_keys_by_place_too():
    # A chunk's queries see what the cache held and the chunk causally, all at one shift.
    q, k, v = raw(seed=1)
    pos = torch.arange(N)
    qt, kt = ROPE.rotate(q, pos), ROPE.rotate(k, pos)
    cache = build("h2o:3+3:rerotate")
    for start in range(0, N, 3):
        end = min(start + 3, N)
        keys, values = cache.update(0, start, kt[:, :, start:end], v[:, :, start:end])
        held = cache.key_positions(0)  # (1, nkv, S): held before the chunk, then the chunk
        query = torch.arange(start, end)[:, None]  # (T, 1)
        y, weights = attend(qt[:, :, start:end], keys, values, held[:, :, None] <= query)
        cache.observe(0, weights)
        for i, p in enumerate(range(start, end)):
            seen = torch.stack([row[row <= p] for row in held[0]])[None]  # (1, nkv, S_i)
            torch.testing.assert_close(y[:, :, i:i + 1], by_place(q, k, v, seen, p), rtol=0,
                                       atol=EXACT)
    assert cache.evicted > 0


def test_a_chunk_past_the_budget_is_refused_under_rerotate_in_one_line():
    cache = build("sink:2+6:rerotate")
    _, k, v = raw()
    with pytest.raises(ValueError, match="feed positions past 7 one at a time") as error:
        cache.update(0, 0, k[:, :, :12], v[:, :, :12])
    assert "\n" not in str(error.value)
    build("sink:2+6").update(0, 0, k[:, :, :12], v[:, :, :12])  # text positions: fine


def test_rerotate_on_a_model_without_rotary_positions_is_refused_in_one_line():
    gpt2 = GPT(GPTConfig(block_size=32, vocab_size=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="needs rotary positions \\(RoPE\\)") as error:
        make_cache("sink:2+8:rerotate", gpt2, 32)
    assert "\n" not in str(error.value)
    assert make_cache("sink:2+8:text", gpt2, 32) is not None


@pytest.mark.parametrize("text, canonical", [
    ("sink:4+252:rerotate", "sink:4+252:rerotate"), ("sink:4+252:text", "sink:4+252"),
    ("window:rerotate:256:k8", "window:256:k8:rerotate"), ("H2O:8+8:REROTATE", "h2o:8+8:rerotate")])
def test_a_position_policy_spells_back_and_text_is_the_default(text, canonical):
    spec = parse_cache_spec(text)
    assert str(spec) == canonical and parse_cache_spec(canonical) == spec
    plain = parse_cache_spec(canonical.removesuffix(":rerotate"))
    assert plain["positions"] == "text"
    assert spec.info.budget(dict(spec.params)) == plain.info.budget(dict(plain.params))


@pytest.mark.parametrize("text, message", [
    ("int4:rerotate", "a rotary position policy \\(rerotate\\) is for a cache that evicts"),
    ("static:text", "static keeps every key at its position in the text"),
    ("sink:4+8:text:rerotate", "positions given twice"),
])
def test_a_bad_position_policy_is_refused_in_one_line(text, message):
    with pytest.raises(CacheSpecError, match=message) as error:
        parse_cache_spec(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("cache, message", [
    ("sink:4+60:rerotate", "needs rotary positions"),
    ("paged:rerotate", "is for a cache that evicts")])
def test_eval_refuses_a_position_policy_it_cannot_apply_with_exit_2(cache, message):
    result = CliRunner().invoke(app, ["eval", "-m", "stdlib-bytes", "--cache", cache,
                                      "--tokens", "80"])
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("\n") == 1, result.output


# ---------------------------------------------------------------------------- on a Llama

LLAMA = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate=64,
                    vocab_size=64, context=64, rope_theta=100.0)


def llama() -> Llama:
    # init_std 0.3: a tiny model at 0.02 repeats one token, and then every cache agrees.
    return init_random(Llama(LLAMA), std=0.3, seed=0).double().eval()


class RawKeys:
    """The literal StreamingLLM cache the reference attention below keeps: keys before
    their rotation, rotated afresh at every read."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k[layer] = torch.cat([self.k[layer], k], 2) if layer in self.k else k
        self.v[layer] = torch.cat([self.v[layer], v], 2) if layer in self.v else v
        return self.k[layer], self.v[layer]


def literal_attention(sinks: int, window: int, policy: str):
    """LlamaAttention.forward written out from the definitions: query p attends positions
    0..S-1 and max(S, p-W+1)..p, each key rotated (by the model's own table) at its text
    position or at its place among them, the query at its own."""
    def forward(self, x, step, rope, cache):
        B, T, _ = x.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_size
        rotary = rope.table
        qkv = self.qkv_proj(x).view(B, T, nh + 2 * nkv, hs).transpose(1, 2)  # unrotated
        q, k, v = qkv.split([nh, nkv, nkv], dim=1)  # (B, nh|nkv, T, hs)
        k, v = cache.append(self.layer, k, v)  # (B, nkv, p + 1, hs)
        out = []
        for t in range(T):
            p = step.start + t
            seen = sorted({*range(min(sinks, p + 1)), *range(max(sinks, p - window + 1), p + 1)})
            at = torch.tensor(seen) if policy == "text" else torch.arange(len(seen))
            keys = rotary(k[:, :, seen], at).repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, hs)
            values = v[:, :, seen].repeat_interleave(nh // nkv, dim=1)
            query = rotary(q[:, :, t:t + 1], at[-1:])  # (B, nh, 1, hs)
            weights = (query @ keys.transpose(-2, -1) / math.sqrt(hs)).softmax(-1)
            out.append(weights @ values)
        y = torch.cat(out, dim=2)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
    return forward


def logits_through(m: Llama, cache, idx: torch.Tensor, prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = [m(idx[:, :prompt], 0, cache)]
        out += [m(idx[:, p:p + 1], p, cache) for p in range(prompt, idx.size(1))]
    return torch.cat(out, dim=1)  # (1, n, vocab)


@pytest.mark.parametrize("policy", ["text", "rerotate"])
def test_a_llama_with_sinks_decodes_as_the_literal_definition_under_each_policy(
        policy, monkeypatch):
    m = llama()
    idx = torch.randint(0, LLAMA.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    got = logits_through(m, make_cache(f"sink:2+10:{policy}", m, 48), idx, prompt=8)
    assert len(set(got[0].argmax(-1).tolist())) > 3  # the model does not repeat one token
    other = "text" if policy == "rerotate" else "rerotate"
    assert (logits_through(m, make_cache(f"sink:2+10:{other}", m, 48), idx, 8) - got
            ).abs().max() > 1e-2  # the policies differ once the sinks have moved
    monkeypatch.setattr(LlamaAttention, "forward",
                        literal_attention(2, 10, "text" if policy == "text" else "cache"))
    want = logits_through(m, RawKeys(), idx, prompt=8)
    # float64; RopeShift's angles are float32, as the model's table is: about 1e-6 of
    # a key, which the logits of a 2-layer model carry at about that size.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_rope_shift_composes_with_the_models_own_rotation():
    m = llama()
    x = torch.randn(1, 2, 5, LLAMA.head_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2))
    pos = torch.arange(3, 8)
    rope = LLAMA.cache_shape.rope
    # float32 angles in both: p then 9 rounds differently from p + 9 (about 1e-6).
    torch.testing.assert_close(rope.rotate(m.rotary(x, pos), torch.tensor(9)),
                               m.rotary(x, pos + 9), rtol=0, atol=1e-5)
    torch.testing.assert_close(rope.rotate(x, pos), m.rotary(x, pos), rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec, sinks, window", [("window:10", 0, 10), ("sink:2+10", 2, 10)])
def test_eval_s_bounded_rows_equal_the_band_mask_fed_a_token_or_a_chunk_a_step(
        spec, sinks, window, monkeypatch):
    """The figures docs/eval.md publishes at 4,096 tokens were fed 32 tokens a step: the
    loss of every scored token is the literal band's, one token a step or a chunk."""
    from kvcache_cli.eval import quality

    m = llama()
    ids = torch.randint(0, LLAMA.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    stepped = quality.evaluate(m, ids.tolist(), [spec], prompt_len=8).cache(spec)
    chunked = quality.evaluate(m, ids.tolist(), [spec], prompt_len=8, chunk=8).cache(spec)
    monkeypatch.setattr(LlamaAttention, "forward", literal_attention(sinks, window, "text"))
    logits = logits_through(m, RawKeys(), ids[None, :47], prompt=8)  # (1, 47, vocab)
    want = -logits[0, 7:].double().log_softmax(-1).gather(1, ids[8:, None])[:, 0]  # (40,)
    # float64 throughout; float32's tolerance all the same, the one the docs claim.
    for row in (stepped, chunked):
        torch.testing.assert_close(torch.tensor(row.loss_by_position, dtype=torch.float64),
                                   want, rtol=0, atol=1e-6)
    assert stepped.kl_mean > 1e-3  # the band is narrower than the text: not the exact row
