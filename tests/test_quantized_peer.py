"""The peer, transformers' QuantizedCache (quanto backend), behind our cache interface."""

import pytest
import torch

from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytest.importorskip("optimum.quanto")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=64)


def test_the_peer_decodes_near_the_exact_cache_and_counts_its_codes():
    m = GPT(CONFIG, init_std=0.3, seed=0).eval()
    idx = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(0))
    logits = {}
    for spec in ("static", "quanto-int4:g32:r8", "quanto-int2:g32:r8"):
        cache = make_cache(spec, m, 60)
        with torch.no_grad():
            steps = [m(idx[:, :20], 0, cache)] + [m(idx[:, p:p + 1], p, cache)
                                                  for p in range(20, 60)]
        logits[spec] = torch.cat(steps, dim=1)
        held = cache.bytes_held
    gap4 = (logits["quanto-int4:g32:r8"] - logits["static"]).abs().max()
    gap2 = (logits["quanto-int2:g32:r8"] - logits["static"]).abs().max()
    assert 0 < gap4 < gap2
    # 2 bits a number for 60 tokens, a float32 scale and shift per 32, at most 7 residual.
    codes = 2 * CONFIG.n_layer * CONFIG.n_head * 60 * 32 * 2 // 8
    assert codes < held < codes * 3


def test_the_peer_refuses_to_roll_back_and_spells_its_defaults():
    m = GPT(CONFIG, seed=0).eval()
    assert str(parse_cache_spec("quanto-int4")) == "quanto-int4:g64:r128"
    with pytest.raises(RollbackError, match="cannot roll back"):
        make_cache("quanto-int4:g32", m, 8).crop(0)
