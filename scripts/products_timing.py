"""The native products (`products.cpp`) as built from a git revision and as built from the
tree, interleaved in one process at a decode's and a batch's rows: medians, the tree's time
over the revision's, and whether the two gave the same bits. The weights lie in 2 MiB pages,
as a loaded model's do (`huge_pages.gather`), and every matrix is larger than the CPU's
caches, so its rows come from memory as in a step.

    PYTHONPATH=$PWD python scripts/products_timing.py --before 5d44722 --threads 2
"""

import statistics
import time

import torch
from revision_source import builds, timing_arguments
from torch import nn

from kvcache_cli.models import huge_pages, linear

parser = timing_arguments(repeats=11)
parser.add_argument("--rows", default="1,2,3,4,8,16", help="rows of x, comma-separated")
args = parser.parse_args()
torch.set_num_threads(args.threads)
tree, before = builds(args.before, linear, "PRODUCTS_SOURCE", linear.load_products)

gen = torch.Generator().manual_seed(0)
# name: (outputs, inputs), the weight rows and their length
shapes = {
    "Gemma 3's head": (262_144, 640),
    "SmolLM2's head": (49_152, 576),
    "SmolLM2's MLP up, 30 layers' worth": (30 * 1536, 576),
}


def product(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    fn = lib.product_f16 if w.dtype == torch.float16 else lib.product_f32
    fn(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), *y.shape, x.shape[1], args.threads)
    return y


print(f"{args.threads} threads, medians of {args.repeats} rounds, ms a product")
for name, (n_out, n_in) in shapes.items():
    for dtype in (torch.float32, torch.float16):
        holder = nn.Module()
        holder.register_buffer("w", (torch.randn(n_out, n_in, generator=gen) * 0.05).to(dtype))
        w = huge_pages.gather(holder).w
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, n_in, generator=gen)
            times = {"before": [], "tree": []}
            for _ in range(args.repeats):
                for label, lib in (("before", before), ("tree", tree)):
                    start = time.perf_counter()
                    product(lib, x, w)
                    times[label].append((time.perf_counter() - start) * 1e3)
            same = torch.equal(product(before, x, w), product(tree, x, w))
            was, now = (statistics.median(times[label]) for label in ("before", "tree"))
            print(f"{name}, {str(dtype)[6:]}, {rows} rows: {args.before} {was:.2f}, "
                  f"tree {now:.2f}, tree / {args.before} {now / was:.2f}, same bits: {same}")
        del holder, w
