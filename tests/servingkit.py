"""What the serving tests share: a tiny model, one seeded workload and the KV memory to
serve it in, and `kvcache serve` run on a checkpoint of that model."""

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.caches.paged import block_bytes
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig, to_hf
from kvcache_cli.serving.sequence import Request, Sequence
from kvcache_cli.serving.workload import WorkloadSpec

CONFIG = GPTConfig(block_size=128, vocab_size=97, n_layer=2, n_head=2, n_embd=16)
SPEC = WorkloadSpec(requests=6, prompt_len=(2, 24), output_len=(2, 16), shared_prefix=10,
                    rate=None, seed=3)
ROOMY = 1 << 20
# 16 blocks of 4: the longest needs 13
TIGHT = 64 * block_bytes(CONFIG.cache_shape, 1, torch.float32)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tiny_model(config: GPTConfig = CONFIG) -> GPT:
    # std 0.3, not GPT-2's 0.02: a tiny model at 0.02 repeats one token forever, and
    # agreeing tokens would prove nothing.
    return GPT(config, init_std=0.3, seed=0).eval()


def seq(tokens, n_new: int = 4, rid: int = 0) -> Sequence:
    return Sequence(Request(rid, tuple(tokens), n_new, 0.0))


def serve_cli(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """The tiny model saved as a Hugging Face checkpoint folder."""
    to_hf(tiny_model()).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"
