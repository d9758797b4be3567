"""Train the shipped byte-level checkpoint: `kvcache_cli/checkpoints/stdlib-bytes/`.

    nice -n 10 python scripts/train_checkpoint.py --plot docs/stdlib-bytes-curve.png
    python scripts/train_checkpoint.py --out /tmp/t --steps 20 --n-layer 1 --n-embd 32
    python scripts/train_checkpoint.py --replot docs/stdlib-bytes-curve.png

The first line is the recipe as shipped (its defaults are `kvcache_cli.models.training.Recipe`);
any Recipe field can be overridden (`--steps`, `--lr`, `--n-embd`, ...). The curve is
printed as it grows and saved with the checkpoint (curve.json, recipe.json); `--replot`
only draws an existing checkpoint's curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvcache_cli.models.training import Recipe, save_checkpoint, stdlib_corpus, train

SHIPPED = Path(__file__).resolve().parent.parent / "kvcache_cli/checkpoints/stdlib-bytes"


def plot_curve(checkpoint: Path, png: Path) -> None:
    """Train and held-out bits per byte against training bytes, from curve.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = json.loads((checkpoint / "curve.json").read_text())
    record = json.loads((checkpoint / "recipe.json").read_text())
    tokens = [p["tokens"] / 1e6 for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(tokens, [p["train_bits"] for p in curve], label="train (mean since last point)")
    ax.plot(tokens, [p["heldout_bits"] for p in curve], label="held-out (first 4,096 bytes)")
    # The whole held-out set is scored once, at the end: a line of its own, not a figure
    # in the title that neither curve reaches.
    ax.axhline(record["heldout_bits"], color="grey", ls=":", lw=1,
               label=f"whole held-out set, at the end: {record['heldout_bits']:.2f}")
    ax.set_xlabel("training bytes (millions)")
    ax.set_ylabel("bits per byte")
    r = record["recipe"]
    ax.set_title(f"stdlib-bytes: {r['n_layer']} layers x {r['n_embd']}, "
                 f"{record['parameters'] / 1e6:.1f}M params, {record['seconds'] / 60:.0f} min "
                 f"on {r['threads']} thread{'s' * (r['threads'] > 1)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SHIPPED)
    parser.add_argument("--plot", type=Path, help="also draw the curve as a PNG here")
    parser.add_argument("--replot", type=Path, help="only draw --out's curve as a PNG here")
    parser.add_argument("--init", type=Path, help="train on from this checkpoint's weights")
    for field in dataclasses.fields(Recipe):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                            default=field.default)
    args = parser.parse_args()
    if args.replot:
        plot_curve(args.out, args.replot)
        return
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    torch.set_num_threads(recipe.threads)
    corpus = stdlib_corpus()
    print(f"{corpus.train.numel():,} training bytes, {len(corpus.heldout):,} held out", flush=True)
    t0 = time.perf_counter()

    def show(p) -> None:
        print(f"step {p.step:5d}  tokens {p.tokens:>10,}  {p.seconds:7.1f} s  lr {p.lr:.2e}  "
              f"train {p.train_bits:.3f}  held-out {p.heldout_bits:.3f} bits/byte", flush=True)

    init = parent = None
    if args.init:
        from kvcache_cli.models.gpt2 import load_gpt2

        init = load_gpt2(str(args.init), weights="pretrained").model
        parent = json.loads((args.init / "recipe.json").read_text())
    model, curve = train(recipe, corpus, show, init)
    record = save_checkpoint(model, args.out, recipe, corpus, curve, time.perf_counter() - t0,
                             init=parent)
    print(f"saved {args.out}: held-out {record['heldout_bits']:.3f} bits/byte over "
          f"{record['heldout_bytes']:,} bytes", flush=True)
    if args.plot:
        plot_curve(args.out, args.plot)


if __name__ == "__main__":
    main()
