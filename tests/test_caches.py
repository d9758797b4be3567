"""The cache family's interface: the spec parser, make_cache, crop, and what attention
asks of a cache (key positions out of order, attention weights handed back)."""

import decoding
import pytest
import torch
from decoding import decode_logits

from kvcache_cli.caches import KVCache, RollbackError, make_cache
from kvcache_cli.caches.base import PositionedCache
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import KINDS, layer_bytes, parse_cache_list, parse_cache_spec
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
# float64 runs the same arithmetic in every cache: they must agree to rounding noise.
EXACT = 1e-12


def model64() -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).double().eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return decoding.tokens(n, CONFIG.vocab_size, seed)  # (1, n)



# ---------------------------------------------------------------------------- specs


# Kinds whose fields have no default: one spelling of each.
EXAMPLES = {"window": "window:8", "sink": "sink:2+6", "h2o": "h2o:4+4", "snapkv": "snapkv:8",
            "knorm": "knorm:0.25", "recent": "recent:8:s2"}


def test_every_registered_kind_parses_its_own_canonical_spelling():
    for name in KINDS:
        spec = parse_cache_spec(EXAMPLES.get(name, name))
        assert parse_cache_spec(str(spec)) == spec


def test_full_is_an_alias_of_static():
    assert parse_cache_spec("full") == parse_cache_spec("static")
    assert str(parse_cache_spec(" FULL ")) == "static"


def test_paged_takes_a_block_size_field():
    assert parse_cache_spec("paged")["block_size"] == 16
    spec = parse_cache_spec("paged:b32")
    assert spec["block_size"] == 32 and str(spec) == "paged:b32"


@pytest.mark.parametrize("text, message", [
    ("statc", "unknown cache 'statc': expected one of .* \\(did you mean static"),
    ("", "unknown cache ''"),
    ("static:4", "static takes no fields"),
    ("paged:x16", "unknown field 'x16'; expected bN"),
    ("paged:b0", "block size '0' is not a whole number from 1 to 4,096"),
    ("paged:b", "block size '' is not a whole number"),
])
def test_a_bad_spec_is_refused_in_one_line_naming_it(text, message):
    with pytest.raises(CacheSpecError, match=message) as error:
        parse_cache_spec(text)
    assert "\n" not in str(error.value)


def test_a_list_keeps_its_order_and_refuses_duplicates():
    assert [str(s) for s in parse_cache_list("concat, static,paged:b8")] == [
        "concat", "static", "paged:b8"]
    with pytest.raises(CacheSpecError, match="'static' is listed twice"):
        parse_cache_list("static,full")
    with pytest.raises(CacheSpecError, match="no cache in ' , '"):
        parse_cache_list(" , ")


def test_layer_bytes_count_keys_and_values_of_every_token():
    # 2 (K and V) x 100 tokens x 8 heads x 64 dims x 2 bytes.
    assert layer_bytes(parse_cache_spec("static"), 100, 8, 64, 2) == 2 * 100 * 8 * 64 * 2
    # A paged cache holds whole blocks: 100 tokens take 7 blocks of 16.
    assert layer_bytes(parse_cache_spec("paged"), 100, 8, 64, 2) == 2 * 112 * 8 * 64 * 2


def test_the_spec_module_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, kvcache_cli.caches.spec as s; s.parse_cache_spec('paged:b8'); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------- make_cache


@pytest.mark.parametrize("spec", ["concat", "static", "paged:b4", "paged:b16"])
def test_every_exact_kind_decodes_the_logits_of_no_cache(spec):
    model, idx = model64(), tokens(24)
    full = decode_logits(model, None, idx, 24)
    assert torch.equal(full, full) and full.abs().max() > 1
    cached = decode_logits(model, make_cache(spec, model, 24), idx, 7)
    assert (cached - full).abs().max().item() <= EXACT


def test_naive_makes_no_cache():
    assert make_cache("naive", model64(), 8) is None


# ---------------------------------------------------------------------------- crop


@pytest.mark.parametrize("spec", ["concat", "static", "paged:b4"])
def test_crop_forgets_the_rejected_tokens(spec):
    # Write 6 wrong tokens after position 12, crop them, then decode the right ones:
    # the logits must be those of a cache that never saw the wrong tokens.
    model, idx = model64(), tokens(20, seed=1)
    wrong = tokens(6, seed=2)
    cache = make_cache(spec, model, 20)
    with torch.no_grad():
        model(idx[:, :12], 0, cache)
        model(wrong, 12, cache)
        cache.crop(12)
        assert cache.length == 12
        after = torch.cat([model(idx[:, p:p + 1], p, cache) for p in range(12, 20)], dim=1)
    full = decode_logits(model, None, idx, 20)[:, 12:]
    assert (after - full).abs().max().item() <= EXACT


def test_crop_past_the_length_is_refused():
    model = model64()
    cache = make_cache("static", model, 8)
    with torch.no_grad():
        model(tokens(4), 0, cache)
    with pytest.raises(RollbackError, match="cannot crop to 5 positions: the cache holds 4"):
        cache.crop(5)


def test_a_cache_without_rollback_refuses_in_one_line():
    class Appending(KVCache):
        pass

    with pytest.raises(RollbackError, match="Appending cannot roll back"):
        Appending().crop(0)


# ---------------------------------------------------------------------------- the interface


class Shuffled(PositionedCache):
    """Every key held in a scrambled slot order, with its position reported: attention
    must then mask by position, not by slot."""

    def __init__(self, n_layer: int, per_head: bool):
        self.k, self.v, self.pos = {}, {}, {}
        self.per_head, self.length, self.bytes_copied = per_head, 0, 0

    def update(self, layer, start_pos, k, v):
        T = k.size(2)
        new = torch.arange(start_pos, start_pos + T)
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
            new = torch.cat([self.pos[layer], new])
        order = torch.randperm(new.numel(), generator=torch.Generator().manual_seed(len(new)))
        self.k[layer], self.v[layer], self.pos[layer] = k[:, :, order], v[:, :, order], new[order]
        self.length = start_pos + T
        return self.k[layer], self.v[layer]

    def key_positions(self, layer):
        pos = self.pos[layer]  # (S,)
        if self.per_head:  # the same positions spelled per row and head: (B, nh, S)
            return pos.expand(1, CONFIG.n_head, -1)
        return pos


@pytest.mark.parametrize("per_head", [False, True])
def test_attention_masks_keys_by_the_positions_a_cache_reports(per_head):
    model, idx = model64(), tokens(16, seed=3)
    full = decode_logits(model, None, idx, 16)
    shuffled = decode_logits(model, Shuffled(CONFIG.n_layer, per_head), idx, 5)
    assert (shuffled - full).abs().max().item() <= EXACT


def test_a_cache_that_wants_attention_gets_each_layers_weights():
    class Watching(Shuffled):
        wants_attention = True

        def __init__(self):
            super().__init__(CONFIG.n_layer, per_head=False)
            self.seen = []

        def attend(self, layer, q, k, v, step):  # H2O's: explicit weights, observed
            keys, values = self.update(layer, step.start, k, v)
            y, weights = step.weighted(q, keys, values, step.visible(self.key_positions(layer)))
            self.observe(layer, weights)
            return y

        def observe(self, layer, weights):
            self.seen.append((layer, weights.shape, weights.sum(-1)))

    model, idx = model64(), tokens(12, seed=4)
    cache = Watching()
    watched = decode_logits(model, cache, idx, 4)
    assert (watched - decode_logits(model, None, idx, 12)).abs().max().item() <= EXACT
    # prefill, then 8 steps, each through both layers: (B, nh, T, S), rows summing to 1
    assert [(layer, shape) for layer, shape, _ in cache.seen[:3]] == [
        (0, (1, 4, 4, 4)), (1, (1, 4, 4, 4)), (0, (1, 4, 1, 5))]
    assert len(cache.seen) == 2 * 9
    for _, _, sums in cache.seen:
        torch.testing.assert_close(sums, torch.ones_like(sums))
