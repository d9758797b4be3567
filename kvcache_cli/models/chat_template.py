"""A model's chat template made into prompts: Jinja in a sandbox, in a child process under
limits, since the template is the model file's text and a file is not trusted to run code.

transformers renders a template in jinja2's `ImmutableSandboxedEnvironment`: no attribute
that reaches Python's internals, no changing the messages, ranges of at most 100,000. The
sandbox bounds what a template may touch, not what it may cost: loops within loops run for
hours, `'x' * 10**10` asks for 10 GB, `9**9**9` computes for minutes. So the rendering runs
in a child process with a wall-clock limit (`RENDER_SECONDS`), a cap on its memory and on
the text it returns, and no template loader (an `include` has no file to read). A template
that fails, in any of these ways, is one ValueError. One child renders every conversation
of a call (`render_chats`): a workload of a hundred prompts pays one start-up (~0.1 s).
Torch-free.
"""

from __future__ import annotations

import json
import subprocess
import sys

RENDER_SECONDS = 10.0  # a real template renders in milliseconds; a child starts in ~0.1 s
MAX_OUTPUT = 2**20  # characters of one prompt: far past any context window
MEMORY_BYTES = 2**30  # the child's address space: Python, jinja2 and the prompts need ~50 MB

# The child: limits first, then jinja2; one JSON line back, the prompts or the error.
_CHILD = r"""
import json, sys
limits = json.loads(sys.argv[1])
sys.path[:0] = limits["path"]
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))
except (ImportError, ValueError, OSError):
    pass  # no resource module (Windows): the wall-clock limit still holds

def render(job):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(job["template"])
    prompts = []
    for messages in job["conversations"]:
        parts, n = [], 0
        for part in template.generate(messages=messages, add_generation_prompt=True,
                                      bos_token=job["bos"], eos_token=job["eos"]):
            n += len(part)
            if n > limits["output"]:
                return {"error": f"its output passed {limits['output']:,} characters"}
            parts.append(part)
        prompts.append("".join(parts))
    return {"prompts": prompts}

try:
    answer = render(json.loads(sys.stdin.read()))
except BaseException as error:
    answer = {"error": f"{type(error).__name__}: {error}"}
sys.stdout.write(json.dumps(answer))
"""


def render_chats(template: str, conversations: list[list[dict]], bos: str = "",
                 eos: str = "") -> list[str]:
    """The prompt `template` makes of each conversation (a list of {role, content}), ready
    for the assistant's reply; a ValueError in one line when the template fails."""
    if not conversations:
        return []
    job = json.dumps({"template": template, "conversations": conversations, "bos": bos,
                      "eos": eos})
    limits = json.dumps({"memory": MEMORY_BYTES, "cpu": int(RENDER_SECONDS) + 1,
                         "output": MAX_OUTPUT, "path": _jinja_path()})
    try:
        # -I -S: no environment, no site packages, no current folder: a bare interpreter
        # that starts in half the time, given only jinja2's own folders.
        run = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, limits], input=job,
                             capture_output=True, text=True, encoding="utf-8",
                             timeout=RENDER_SECONDS)
    except subprocess.TimeoutExpired:
        raise ValueError(f"the model's chat template does not render: it ran past "
                         f"{RENDER_SECONDS:g} s") from None
    try:
        answer = json.loads(run.stdout)
    except ValueError:  # killed by a limit before it could answer
        how = f"signal {-run.returncode}" if run.returncode < 0 else f"exit {run.returncode}"
        raise ValueError("the model's chat template does not render: its renderer ended "
                         f"({how}) past a limit of time or memory") from None
    if "error" in answer:
        detail = " ".join(str(answer["error"]).split())
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        raise ValueError(f"the model's chat template does not render: {detail}")
    return answer["prompts"]


def _jinja_path() -> list[str]:
    """The folders jinja2 and markupsafe are imported from (found, not imported)."""
    from importlib.util import find_spec
    from pathlib import Path

    folders = []
    for name in ("jinja2", "markupsafe"):
        spec = find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"rendering a chat template needs {name}, which is not "
                             "installed: pip install jinja2")
        folder = str(Path(next(iter(spec.submodule_search_locations))).parent)
        if folder not in folders:
            folders.append(folder)
    return folders


def render_chat(template: str, messages: list[dict], bos: str = "", eos: str = "") -> str:
    """The prompt `template` makes of one conversation (`render_chats`)."""
    return render_chats(template, [messages], bos, eos)[0]
