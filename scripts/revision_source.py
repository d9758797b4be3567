"""A kernel's source as a git revision had it, for the timing scripts that build it beside
the tree's and call both in one process (attention_blocks_timing.py, products_timing.py)."""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_at(revision: str, source: Path) -> Path:
    """`source` (a kernel's .cpp in the package) as `revision` has it, in a new folder with the
    headers beside it (the revision's, or the tree's where it has none yet), so that it builds
    as it did then. Exits 2 with one line where the revision has no such source."""
    folder = Path(tempfile.mkdtemp())
    for path in [source, *source.parent.glob("*.h")]:
        name = path.relative_to(ROOT).as_posix()
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{name}"],
                               capture_output=True)
        if shown.returncode != 0 and path == source:
            why = shown.stderr.decode(errors="replace").strip().splitlines()[-1:]
            print(f"error: --before {revision}: no {name} there ({' '.join(why)})",
                  file=sys.stderr)
            raise SystemExit(2)
        (folder / path.name).write_bytes(shown.stdout if shown.returncode == 0
                                         else path.read_bytes())
    return folder / source.name


def timing_arguments(repeats: int) -> argparse.ArgumentParser:
    """The flags every such script takes: --before, --threads, --repeats."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="the git revision to build beside the tree")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def builds(revision: str, module, attribute: str, load) -> tuple:
    """(the tree's library, the revision's): `load()` as the tree is, then again with
    `module.attribute`, the source it builds, the revision's (`source_at`)."""
    tree, why = load()
    setattr(module, attribute, source_at(revision, getattr(module, attribute)))
    before, why_before = load()
    if tree is None or before is None:
        raise SystemExit(f"the kernel did not build: {why or why_before}")
    return tree, before
