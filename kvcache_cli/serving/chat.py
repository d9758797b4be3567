"""The chat workload: requests made by a chat model's own template, as a chat server sees them.

Every request is one conversation: the same system prompt (so every prompt starts with
the same tokens, the prefix vLLM's prefix caching serves), then one user turn drawn by
the seed from a set of questions, a word to a few paragraphs long, and the template's
assistant header. A reply ends at the model's end-of-turn token or at a cap, so reply
lengths and stops are the model's own. The set ships with the package
(`data/chat_prompts.json`); `--workload FILE` reads another of the same shape:
`{"system": "...", "prompts": ["...", ...]}`. Torch-free: the template renders and the
tokenizer encodes before any weights load, and a bad file is refused then.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvcache_cli.serving.sequence import Request

SHIPPED = Path(__file__).parent / "data" / "chat_prompts.json"
WORKLOADS = ("chat", "random")
# A set of more prompts than this is a data set, not a workload file.
MAX_PROMPTS = 100_000
MAX_FILE_BYTES = 64 << 20


@dataclass(frozen=True)
class ChatSet:
    system: str
    prompts: tuple[str, ...]
    source: str  # "the shipped set" or the file's path


@dataclass(frozen=True)
class ChatRequests:
    """A chat workload's prompts, rendered and encoded, and what they share."""

    prompts: tuple[tuple[int, ...], ...]  # token ids, one per request
    shared_prefix: int  # tokens every prompt starts with: the system turn and what follows it
    system_text: str
    source: str
    stop_ids: tuple[int, ...]  # the end-of-turn token first
    stop_names: tuple[str, ...]  # their text, e.g. <|im_end|>


def load_set(path: Path | None) -> ChatSet:
    """The shipped set, or a workload file's; a file that does not parse is one line."""
    where = SHIPPED if path is None else path
    name = "the shipped set" if path is None else str(path)
    expected = 'expected JSON {"system": "...", "prompts": ["...", ...]}'
    try:
        if where.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"--workload {name}: larger than {MAX_FILE_BYTES >> 20} MiB; "
                             f"{expected}")
        data = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--workload {name}: no such file; expected chat, random or a "
                         "JSON file of chat prompts") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--workload {name}: cannot be read ({type(err).__name__}); "
                         f"{expected}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--workload {name}: not JSON (line {err.lineno}, column "
                         f"{err.colno}: {err.msg}); {expected}") from None
    system = data.get("system") if isinstance(data, dict) else None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(system, str) or not isinstance(prompts, list) or not prompts \
            or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"--workload {name}: {expected}, every prompt a non-empty string")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"--workload {name}: {len(prompts):,} prompts; expected at most "
                         f"{MAX_PROMPTS:,}")
    return ChatSet(system, tuple(prompts), name)


def draw(chat: ChatSet, n: int, seed: int) -> list[str]:
    """n user turns: a seeded shuffle of the set, then another, as many as it takes, so a
    prompt repeats only once every one has been drawn (a repeat would hit past the system
    prompt, and the hit rate is the system prompt's)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        order = list(chat.prompts)
        rng.shuffle(order)
        out += order[: n - len(out)]
    return out


def check_template(config, model: str, workload: str = "chat") -> str:
    """The model's chat template; a ValueError naming `workload` (chat or a file's path,
    both rendered through it) when it has none."""
    template = getattr(config, "chat_template", None)
    if not template:
        raise ValueError(f"--workload {workload}: model {model!r} has no chat template; "
                         "expected a chat model such as smollm2, or --workload random")
    return template


def build(chat: ChatSet, config, model: str, n: int, seed: int) -> ChatRequests:
    """n requests through the model's template and tokenizer (ValueError in one line)."""
    from kvcache_cli.models.chat_template import render_chats
    from kvcache_cli.models.tokenizer import encoding_for

    template = check_template(config, model)
    encoding, why = encoding_for(config.tokenizer)
    if encoding is None:
        raise ValueError(f"--workload chat: model {model!r}'s tokenizer: {why}")
    texts = render_chats(template, [[{"role": "system", "content": chat.system},
                                     {"role": "user", "content": user}]
                                    for user in draw(chat, n, seed)])
    prompts = [tuple(encoding.encode(text)) for text in texts]
    stop_ids = tuple(config.eos_ids)
    if not stop_ids:
        raise ValueError(f"--workload chat: model {model!r} names no end-of-turn token; "
                         "expected a chat model whose config gives eos_token_id")
    return ChatRequests(
        prompts=tuple(prompts), shared_prefix=_common_prefix(prompts), system_text=chat.system,
        source=chat.source, stop_ids=stop_ids,
        stop_names=tuple(encoding.decode([t]) for t in stop_ids))


def _common_prefix(prompts: list[tuple[int, ...]]) -> int:
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    # With one prompt, or all equal, the last token is not shared: it is the prompt's own.
    return min(n, len(first) - 1) if len(prompts) > 1 else 0


def requests(chat: ChatRequests, max_reply: int) -> tuple[Request, ...]:
    """The prompts as requests arriving at once (`workload.with_arrivals` times them)."""
    return tuple(Request(i, p, max_reply, 0.0, chat.stop_ids)
                 for i, p in enumerate(chat.prompts))
