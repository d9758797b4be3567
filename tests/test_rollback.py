"""Rollback on every cache kind: crop in the registry's kinds, and serve's pool handing
back the tail blocks of a sequence (never one another sequence holds)."""

import pytest
import torch
from cachekinds import example_spec

from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.paged import PagedCache, block_bytes
from kvcache_cli.caches.spec import KINDS, parse_cache_spec
from kvcache_cli.models.gpt2 import GPT, GPTConfig
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.pooled import PooledSequence
from kvcache_cli.serving.sequence import Request, Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Head width 32, so quantised kinds' groups of 32 fit.
CONFIG = GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=2, n_embd=64)
ROLLBACK = [name for name, kind in KINDS.items() if kind.rollback]


def _model() -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).double().eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (1, n), generator=g)  # (1, n)


def _seq(tokens, rid: int = 0) -> Sequence:
    return Sequence(Request(rid, tuple(tokens), 8, 0.0))


# ---------------------------------------------------------------------------- every kind


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("size", [4, 32])  # bounded kinds: evicting before the crop, or not
def test_every_kind_forgets_the_rejected_tokens_or_refuses_in_one_line(kind, size):
    # Six wrong tokens after position 12, cropped, then the right ones: the logits are
    # those of the same kind of cache that never saw the wrong tokens.
    model, idx, wrong = _model(), _ids(20, 1), _ids(6, 2)
    spec = example_spec(kind, size)
    cache, clean = make_cache(spec, model, 20), make_cache(spec, model, 20)
    with torch.no_grad():
        model(idx[:, :12], 0, cache)
        model(idx[:, :12], 0, clean)
        model(wrong, 12, cache)
        try:
            cache.crop(12)
        except RollbackError as error:  # a kind that cannot says why, in one line
            assert str(error) and "\n" not in str(error)
            assert not KINDS[kind].rollback or not KINDS[kind].exact, str(error)
            return
        assert KINDS[kind].rollback, f"{kind} rolled back but its registry entry says it cannot"
        assert cache.length == 12
        after = torch.cat([model(idx[:, p:p + 1], p, cache) for p in range(12, 20)], dim=1)
        expected = torch.cat([model(idx[:, p:p + 1], p, clean) for p in range(12, 20)], dim=1)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-9)  # float64: one computation


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_crop_copies_nothing_on_static_and_paged(kind):
    model = _model()
    cache = make_cache(kind, model, 24)
    with torch.no_grad():
        model(_ids(20, 0), 0, cache)
    copied = cache.bytes_copied
    cache.crop(5)
    assert cache.bytes_copied == copied and cache.length == 5


def test_every_kind_says_in_the_registry_how_it_rolls_back_and_what_that_touches():
    for name, kind in KINDS.items():
        assert kind.rollback == kind.rollback.strip() and "\n" not in kind.rollback, name
        assert not kind.rollback or kind.rollback_bytes, f"{name}: no rollback_bytes"
    assert {"static", "concat", "paged"} <= set(ROLLBACK)


# ---------------------------------------------------------------------------- the pool


def test_trim_returns_the_tail_blocks_to_the_free_list():
    blocks = BlockManager(n_blocks=8, block_size=4, prefix_sharing=False)
    s = _seq(range(5))
    blocks.allocate(s)
    blocks.reserve(s, 17)  # a speculative step: positions up to 16, five blocks
    s.num_cached = 17
    assert blocks.blocks_in_use == 5
    tail = s.block_table[2:]
    blocks.trim(s, 6)  # 6 positions: two blocks
    assert len(s.block_table) == 2 and s.num_cached == 6 and blocks.blocks_in_use == 2
    assert list(blocks.free_blocks)[-3:] == tail[::-1]  # the tail first
    blocks.trim(s, 6)  # nothing past the end: nothing changes
    assert blocks.blocks_in_use == 2


def test_trim_drops_a_shared_blocks_reference_and_never_frees_it():
    blocks = BlockManager(n_blocks=8, block_size=4)
    prefix = list(range(10, 22))  # three full blocks
    a, b = _seq(prefix + [1]), _seq(prefix + [2, 3], rid=1)
    blocks.allocate(a)
    blocks.allocate(b)
    shared = b.block_table[2]
    assert blocks.refcount[shared] == 2
    b.num_cached = 14
    own = b.block_table[3]
    free_before = set(blocks.free_blocks)
    blocks.trim(b, 8)
    assert blocks.refcount[shared] == 1 and set(blocks.free_blocks) - free_before == {own}
    assert a.block_table[2] == shared


def test_trim_into_a_shared_block_is_refused_in_one_line():
    blocks = BlockManager(n_blocks=8, block_size=4)
    prefix = list(range(10, 18))
    a, b = _seq(prefix + [1]), _seq(prefix + [2], rid=1)
    blocks.allocate(a)
    blocks.allocate(b)
    b.num_cached = 9
    with pytest.raises(RollbackError, match=r"^cannot roll back to 6 positions: block \d+ is "
                       r"shared with 1 other sequence\(s\)") as error:
        blocks.trim(b, 6)
    assert "\n" not in str(error.value) and b.num_cached == 9


def test_trim_past_what_the_sequence_holds_is_refused():
    blocks = BlockManager(n_blocks=4, block_size=4)
    s = _seq(range(3))
    blocks.allocate(s)
    with pytest.raises(RollbackError, match="cannot roll back to 5 positions: the sequence "
                                            "holds 0; expected 0..0"):
        blocks.trim(s, 5)


def test_a_block_cut_by_a_trim_loses_its_prefix_hash():
    # Its slots past the cut will hold other tokens: a later prefix hit on its old
    # hash would read them.
    blocks = BlockManager(n_blocks=8, block_size=4)
    s = _seq(range(9))
    blocks.allocate(s)
    s.num_cached = 9
    cut = s.block_table[1]
    assert blocks.block_hash[cut] is not None
    blocks.trim(s, 6)
    assert blocks.block_hash[cut] is None and cut in s.block_table
    again = _seq(range(9), rid=1)
    blocks.allocate(again)
    assert again.block_table[1] != cut and again.num_cached == 4


def test_a_pooled_sequence_decodes_the_logits_of_a_static_cache_after_a_rollback():
    model, idx, wrong = _model(), _ids(20, 3), _ids(7, 4)
    manager = BlockManager(8, 4, prefix_sharing=False)
    pool = PagedCache(CONFIG.cache_shape, 8, 4, "cpu", torch.float64)
    seq = _seq(idx[0, :12].tolist())
    cache = PooledSequence(pool, manager, seq)
    static = make_cache("static", model, 20)
    with torch.no_grad():
        model(idx[:, :12], 0, cache)
        model(idx[:, :12], 0, static)
        model(wrong, 12, cache)  # 19 positions: five blocks
        assert manager.blocks_in_use == 5
        copied = cache.bytes_copied
        cache.crop(12)
        assert manager.blocks_in_use == 3 and cache.bytes_copied == copied
        got = torch.cat([model(idx[:, p:p + 1], p, cache) for p in range(12, 20)], dim=1)
        want = torch.cat([model(idx[:, p:p + 1], p, static) for p in range(12, 20)], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    assert cache.bytes_held == 5 * block_bytes(CONFIG.cache_shape, 4, torch.float64)
    cache.reset()
    assert manager.blocks_in_use == 0


def test_paged_rollback_is_registered_as_freeing_tail_blocks():
    assert "tail blocks" in parse_cache_spec("paged").info.rollback
