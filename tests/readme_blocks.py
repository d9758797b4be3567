"""The command examples of README.md and of every page in docs/, run for real: check them
against the pages, or rewrite them.

    python tests/readme_blocks.py           # check: print every difference, exit 1 if any
    python tests/readme_blocks.py --write   # rewrite the exact blocks that differ

A block is a ```text fence whose first line is a `$ command`. Each `$ ` line is run, and
what follows it, up to the next `$ ` line, is its output (stdout and stderr, in order).

- **Exact blocks** are compared line for line with a real run, after `normalise`: trailing
  spaces go (rich pads its tables), and so do timings (`4.3 ms`, `568.8 tokens/s`), which no
  two runs share, and the float32 rounding of the GPT-2 breaks' control (`max |Δ logit|
  8.1e-06`), which moves with the CPU's matmul kernels and thread count. Every other figure
  must match.
- **Measured blocks** (`<!-- measured -->` on the line above the fence) hold timings taken on
  a quiet machine. They are not run, because they take minutes (bench, serve). Their shape is
  checked instead: every command must be accepted by the CLI as it is now (it is parsed with
  `--help` appended, which runs nothing), and every column heading of their tables (the line
  above a `───` rule) must be one that a renderer in kvcache_cli/views still prints.

Every page's commands run in one temporary folder. A block that holds a `python3 -c` recipe
makes files (the tiny checkpoint) that blocks on any page may use, so the recipe blocks run
first, one after another in page order (README.md, then docs/ by name), and every other block
waits for all of them; then blocks run side by side, one per core. Within a block, commands
run in order. The environment is fixed: 100 columns for the pages in docs/ (the width a file
or a pipe gets) and 80 for the README (a newcomer's narrow terminal), HF_HUB_OFFLINE=1 and a
Hub cache holding only Qwen/Qwen2.5-7B-Instruct's config.json, so no command touches the
network and a Hub id example reads the same everywhere.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hubcache import (  # noqa: E402  (this file also runs as a script)
    QWEN_INSTRUCT,
    QWEN_INSTRUCT_COMMIT,
    QWEN_INSTRUCT_ID,
    add_snapshot,
)

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
MEASURED = "<!-- measured -->"
# What the installed `kvcache` script does, from this interpreter: no reliance on where pip
# put the script, and argv[0] named so that messages say `kvcache`, as a user's would.
KVCACHE = [sys.executable, "-c",
           "import sys; sys.argv[0] = 'kvcache'; from kvcache_cli.cli import main; main()"]
# The width each page's examples are laid out at (see the module docstring).
COLUMNS, PAGE_COLUMNS = "100", {"README.md": "80"}

# A duration or a rate, with its unit: what no two runs share.
_TIMING = re.compile(r"\d[\d,]*(?:\.\d+)?(?= (?:ms|s|tokens/s)\b)")
# The control's float32 rounding: its size is the claim, its digits are the kernels'.
_ROUNDING = re.compile(r"(?<=max \|Δ logit\| )\d\.\de-0[5-9]")
_RULE = re.compile(r"^\s*─[─\s]*$")
_ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Example:
    command: str
    output: tuple[str, ...]
    gap: bool  # a blank line parts it from the next command in the block


@dataclass(frozen=True)
class Block:
    start: int  # index of the opening fence among its page's lines
    end: int  # index of the closing fence
    measured: bool
    examples: tuple[Example, ...]


def pages() -> dict[str, str]:
    """README.md and every docs/*.md, by path from the repository, in page order."""
    names = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md"))]
    return {name: (REPO / name).read_text(encoding="utf-8") for name in names}


def parse(text: str) -> list[Block]:
    """Every ```text block of TEXT that starts with a `$ ` command."""
    lines = text.split("\n")
    found = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```text":
            i += 1
            continue
        end = lines.index("```", i + 1)
        body = lines[i + 1:end]
        if body and body[0].startswith("$ "):
            measured = i > 0 and lines[i - 1].strip() == MEASURED
            found.append(Block(i, end, measured, tuple(_examples(body))))
        i = end + 1
    return found


def _examples(body: list[str]) -> list[Example]:
    starts = [n for n, line in enumerate(body) if line.startswith("$ ")]
    examples = []
    for first, after in zip(starts, [*starts[1:], len(body)]):
        output = body[first + 1:after]
        gap = bool(output) and output[-1] == ""
        while output and output[-1] == "":
            output.pop()
        examples.append(Example(body[first][2:], tuple(output), gap))
    return examples


def normalise(lines: tuple[str, ...] | list[str]) -> list[str]:
    """What must match: trailing spaces, timings and float32 rounding removed."""
    return [_ROUNDING.sub("<r>", _TIMING.sub("<t>", line.rstrip())) for line in lines]


def argv(command: str, workdir: Path) -> tuple[dict[str, str], list[str]]:
    """(extra environment, argv) for a page's command: `kvcache ...` as its entry point runs
    it, `python3 ...` through this interpreter; `VAR=value` prefixes go to the env."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and _ENV_WORD.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    program, args = words[0], words[1:]
    if program == "kvcache":
        return env, [*KVCACHE, *args]
    if program in ("python", "python3"):
        # A script named relative to the repository (kv_cache_from_scratch.py).
        args = [str(REPO / a) if a.endswith(".py") and (REPO / a).is_file() else a for a in args]
        return env, [sys.executable, *args]
    raise ValueError(f"command {command!r}: expected kvcache or python3")


def environment(workdir: Path, columns: str = COLUMNS) -> dict[str, str]:
    """The fixed environment every command runs in (see the module docstring)."""
    cache = workdir / ".hub-cache"
    if not cache.is_dir():
        add_snapshot(cache, QWEN_INSTRUCT_ID, QWEN_INSTRUCT_COMMIT, QWEN_INSTRUCT, "main")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE", "TRANSFORMERS_", "COLUMNS", "LINES"))}
    return env | {"COLUMNS": columns, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                  "HF_HUB_CACHE": str(cache), "HF_HOME": str(workdir / ".hf-home")}


THREADS_NOTE = "note: other processes keep "


def run(command: str, workdir: Path, columns: str = COLUMNS) -> list[str]:
    """The command's output lines, stdout and stderr interleaved as a terminal shows them."""
    extra, args = argv(command, workdir)
    done = subprocess.run(args, cwd=workdir, env=environment(workdir, columns) | extra, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    # The thread note depends on what else the machine runs, as timings do: the pages show a
    # quiet machine's run.
    lines = [line.rstrip() for line in done.stdout.replace(str(workdir) + os.sep, "").split("\n")
             if not line.startswith(THREADS_NOTE)]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _headings() -> set[str]:
    """Every quoted string in the renderers' sources: the column headings they can print."""
    views = REPO / "kvcache_cli" / "views"
    source = "\n".join(p.read_text(encoding="utf-8") for p in sorted(views.glob("*.py")))
    return set(re.findall(r'"([^"\n]+)"', source))


def check_measured(page: str, block: Block, workdir: Path) -> list[str]:
    """The shape of a measured block, without running it (see the module docstring)."""
    problems = []
    known = _headings()
    for example in block.examples:
        extra, args = argv(example.command, workdir)
        done = subprocess.run([*args, "--help"], cwd=workdir, env=environment(workdir) | extra,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            problems.append(f"{page} line {block.start + 2}: `{example.command}` is refused now: "
                            f"{done.stderr.strip()}")
        lines = example.output
        for above, line in zip(lines, lines[1:]):
            if not _RULE.match(line):
                continue
            for heading in re.split(r"\s{2,}", above.strip()):
                # `@n` columns are context lengths; `×mode` ratios are built from a mode name.
                if not (re.fullmatch(r"@\d+", heading) or heading in known
                        or heading.startswith("×") and heading[1:] in known):
                    problems.append(f"{page}: `{example.command}`: table heading {heading!r} "
                                    "is not one kvcache_cli/views prints")
    return problems


def _is_recipe(example: Example) -> bool:
    """A `python3 -c` line makes files (the tiny checkpoint) that later blocks use."""
    return example.command.startswith(("python3 -c", "python -c"))


Located = tuple[str, Block]  # a block and the page it is on


def run_blocks(blocks: list[Located], workdir: Path) -> dict[tuple[str, int], list[list[str]]]:
    """Each exact block's outputs, keyed by its page and start: the recipe blocks one after
    another, then every other block side by side, one per core (see the module docstring)."""
    exact = [(page, block) for page, block in blocks if not block.measured]
    recipes = [located for located in exact if any(_is_recipe(e) for e in located[1].examples)]
    futures = {}
    environment(workdir)  # lays out the Hub cache once, before threads race to make it
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        def run_block(page: str, block: Block, after: tuple[Future, ...]) -> list[list[str]]:
            wait(after)
            columns = PAGE_COLUMNS.get(page, COLUMNS)
            return [run(e.command, workdir, columns) for e in block.examples]

        made: tuple[Future, ...] = ()
        for page, block in recipes:
            futures[page, block.start] = pool.submit(run_block, page, block, made)
            made = (futures[page, block.start],)
        for page, block in exact:
            if (page, block.start) not in futures:
                futures[page, block.start] = pool.submit(run_block, page, block, made)
        return {key: future.result() for key, future in futures.items()}


def _blocks(texts: dict[str, str], select: Callable[[Block], bool]) -> list[Located]:
    return [(page, block) for page, text in texts.items() for block in parse(text)
            if select(block)]


def check(texts: dict[str, str], select: Callable[[Block], bool] = lambda block: True
          ) -> list[str]:
    """Every difference between the blocks of TEXTS (page → text) and real runs, one message
    each."""
    problems = []
    blocks = _blocks(texts, select)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        outputs = run_blocks(blocks, workdir)
        for page, block in blocks:
            if block.measured:
                problems += check_measured(page, block, workdir)
                continue
            for example, output in zip(block.examples, outputs[page, block.start]):
                want, got = normalise(example.output), normalise(output)
                if want != got:
                    diff = "\n".join(difflib.unified_diff(want, got, page, "real run",
                                                          lineterm=""))
                    problems.append(f"{page} line {block.start + 2}: `{example.command}` "
                                    f"prints something else now:\n{diff}")
    return problems


def write(texts: dict[str, str], select: Callable[[Block], bool] = lambda block: True
          ) -> dict[str, str]:
    """TEXTS (page → text) with every exact block's outputs replaced by a real run's, where
    they differ by more than timings."""
    blocks = _blocks(texts, select)
    with tempfile.TemporaryDirectory() as tmp:
        outputs = run_blocks(blocks, Path(tmp))
    written = {}
    for page, text in texts.items():
        lines = text.split("\n")
        # From the last block up, so that the line numbers of the blocks above stay valid.
        for block in reversed([b for p, b in blocks if p == page and not b.measured]):
            body = []
            for n, (example, output) in enumerate(zip(block.examples, outputs[page, block.start])):
                if normalise(output) == normalise(example.output):
                    output = example.output  # only the timings differ: keep the page's
                body += [f"$ {example.command}", *output]
                if example.gap and n < len(block.examples) - 1:
                    body.append("")
            lines[block.start + 1:block.end] = body
        written[page] = "\n".join(lines)
    return written


def main() -> int:
    texts = pages()
    if "--write" in sys.argv[1:]:
        for page, text in write(texts).items():
            if text != texts[page]:
                (REPO / page).write_text(text, encoding="utf-8")
                print(f"rewrote {page}")
        return 0
    problems = check(texts)
    print("\n\n".join(problems) if problems else "every page's examples match real runs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
