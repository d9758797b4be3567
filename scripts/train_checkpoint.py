"""Train the shipped byte-level checkpoint: `kvcache_cli/checkpoints/stdlib-bytes/`.

    nice -n 10 python scripts/train_checkpoint.py            # the recipe as shipped
    python scripts/train_checkpoint.py --out /tmp/t --steps 20 --n-layer 1 --n-embd 32

Any Recipe field can be overridden (`--steps`, `--lr`, `--n-embd`, ...). The curve is
printed as it grows and saved with the checkpoint (curve.json, recipe.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from kvcache_cli.training import Recipe, save_checkpoint, stdlib_corpus, train

SHIPPED = Path(__file__).resolve().parent.parent / "kvcache_cli/checkpoints/stdlib-bytes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SHIPPED)
    for field in dataclasses.fields(Recipe):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                            default=field.default)
    args = parser.parse_args()
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    torch.set_num_threads(recipe.threads)
    corpus = stdlib_corpus()
    print(f"{corpus.train.numel():,} training bytes, {len(corpus.heldout):,} held out", flush=True)
    t0 = time.perf_counter()

    def show(p) -> None:
        print(f"step {p.step:5d}  tokens {p.tokens:>10,}  {p.seconds:7.1f} s  lr {p.lr:.2e}  "
              f"train {p.train_bits:.3f}  held-out {p.heldout_bits:.3f} bits/byte", flush=True)

    model, curve = train(recipe, corpus, show)
    record = save_checkpoint(model, args.out, recipe, corpus, curve, time.perf_counter() - t0)
    print(f"saved {args.out}: held-out {record['heldout_bits']:.3f} bits/byte over "
          f"{record['heldout_bytes']:,} bytes", flush=True)


if __name__ == "__main__":
    main()
