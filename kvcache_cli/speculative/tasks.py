"""Speculative decoding on chat tasks: the shipped tasks (answers that copy the prompt and
answers that do not), each run through the chat template with every draft and K, and
the table of acceptance and forwards per token they give (`kvcache bench --tasks`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache_cli.models.base import FamilyModel
from kvcache_cli.speculative.decode import Speculation, plain_greedy, speculate
from kvcache_cli.speculative.drafts import Draft

TASKS = Path(__file__).parent / "data" / "speculative_tasks.json"
TASK_SETS = ("copy", "other")


@dataclass(frozen=True)
class ChatTask:
    kind: str  # "copy": the reply copies from the prompt (edit, fix); "other": new text
    index: int  # its place in its set
    prompt_ids: tuple[int, ...]  # through the model's chat template


def chat_tasks(config, model: str, sets: Sequence[str] = TASK_SETS) -> tuple[ChatTask, ...]:
    """The shipped tasks, rendered by the model's chat template and encoded (torch-free);
    ValueError in one line for a model without a template."""
    import json

    from kvcache_cli.models.chat_template import render_chats
    from kvcache_cli.models.tokenizer import encoding_for

    template = getattr(config, "chat_template", None)
    if not template:
        raise ValueError(f"model {model!r} has no chat template; expected a chat model "
                         "such as smollm2")
    encoding, why = encoding_for(config.tokenizer)
    if encoding is None:
        raise ValueError(f"model {model!r}'s tokenizer: {why}")
    data = json.loads(TASKS.read_text(encoding="utf-8"))
    which = [(kind, i, user) for kind in sets for i, user in enumerate(data[kind])]
    texts = render_chats(template, [[{"role": "system", "content": data["system"]},
                                     {"role": "user", "content": user}]
                                    for _, _, user in which])
    return tuple(ChatTask(kind, i, tuple(encoding.encode(text)))
                 for (kind, i, _), text in zip(which, texts))


@dataclass(frozen=True)
class TaskRun:
    """One task, one cache: plain greedy to the end of turn, then each draft at each K
    for exactly as many tokens."""

    kind: str
    index: int
    cache: str
    prompt_tokens: int
    reply_tokens: int  # plain greedy's reply, its end-of-turn token included
    stopped: bool  # the reply ended at the end-of-turn token, not the cap
    plain_s: float
    runs: tuple[Speculation, ...]
    identical: tuple[bool, ...]  # per run: its tokens are plain greedy's


@dataclass(frozen=True)
class TaskRow:
    """One (task set, cache, draft, K) over the set's tasks, summed."""

    kind: str
    cache: str
    draft: str
    k: int
    tasks: int
    tokens: int
    proposed: int
    accepted: int
    acceptance: float  # accepted / proposed
    forwards_per_token: float  # the target's: 1.0 is plain decoding
    speedup: float  # plain's seconds over speculation's, summed over the tasks
    identical: int  # tasks whose tokens are plain greedy's


@dataclass(frozen=True)
class TaskTable:
    model: str
    cap: int
    threads: int
    runs: tuple[TaskRun, ...]
    rows: tuple[TaskRow, ...]

    @property
    def all_identical(self) -> bool:
        return all(all(r.identical) for r in self.runs)


def check_tasks(config, model: str, sets: Sequence[str], drafts, ks: Sequence[int],
                cache: str, cap: int) -> tuple[tuple[ChatTask, ...], tuple[int, ...]]:
    """(the tasks, the end-of-turn ids) for a run about to load `model`, or a ValueError in
    one line (RollbackError and CacheSpecError among them): an unknown set, a model without
    a chat template or an end-of-turn token, replies past the context, a draft that needs a
    second model or is as deep as the target, a cache that cannot roll back."""
    from kvcache_cli.speculative.decode import check_speculation

    bad = [s for s in sets if s not in TASK_SETS]
    if bad or not sets:
        raise ValueError(f"--tasks {','.join(sets)!r}: expected {' or '.join(TASK_SETS)}, "
                         "comma-separated")
    tasks = chat_tasks(config, model, sets)
    if not config.eos_ids:
        raise ValueError(f"model {model!r} names no end-of-turn token")
    longest = max(len(t.prompt_ids) for t in tasks) + cap
    if longest > config.context:
        raise ValueError(f"--new-tokens {cap}: the longest task ({longest - cap} tokens) and "
                         f"its reply pass the context window {config.context}")
    for spec in drafts:
        if spec.kind == "model":
            raise ValueError(f"draft {spec}: expected lookup[:n] or layers:N (this table "
                             "measures drafts that need no second model)")
        check_speculation(config, spec, None, ks, cache, positions=longest)
    return tasks, tuple(config.eos_ids)


def run_tasks(model: FamilyModel, model_name: str, tasks: Sequence[ChatTask],
              drafts: Sequence[Draft], ks: Sequence[int], cache: str, cap: int,
              stop_ids: Sequence[int], threads: int,
              progress: Callable[[TaskRun], None] | None = None) -> TaskTable:
    """Every task through `run_task`, and the table of its rows; `progress` hears of each
    task as it ends (a set runs minutes on a CPU)."""
    runs = []
    for task in tasks:
        runs.append(run_task(model, task, drafts, ks, cache, cap, stop_ids))
        if progress is not None:
            progress(runs[-1])
    return TaskTable(model_name, cap, threads, tuple(runs), task_rows(runs))


def run_task(model: FamilyModel, task: ChatTask, drafts: Sequence[Draft], ks: Sequence[int],
             cache: str, cap: int, stop_ids: Sequence[int]) -> TaskRun:
    """Plain greedy to the end of turn (or `cap`), then every draft at every K for exactly
    that many tokens: the same tokens, or a bug. A dropped warm-up runs first."""
    from kvcache_cli.generate import generate

    prompt = list(task.prompt_ids)
    plain_greedy(model, prompt, min(cap, 8), cache)  # dropped: first-call allocations
    start = time.perf_counter()
    reply = generate(model, prompt, cap, cache, stop_ids=stop_ids)
    plain_s = time.perf_counter() - start
    n = len(reply.tokens)
    runs = tuple(speculate(model, prompt, n, d, k, cache=cache) for d in drafts for k in ks)
    return TaskRun(task.kind, task.index, cache, len(prompt), n, reply.stopped, plain_s, runs,
                   tuple(r.tokens == reply.tokens for r in runs))


def task_rows(runs: Sequence[TaskRun]) -> tuple[TaskRow, ...]:
    """Each (set, cache, draft, K) summed over its tasks: acceptance over every proposal,
    forwards over every token, seconds over every task."""
    groups: dict[tuple, list[tuple[TaskRun, Speculation, bool]]] = {}
    for t in runs:
        for s, same in zip(t.runs, t.identical, strict=True):
            groups.setdefault((t.kind, t.cache, s.draft, s.k), []).append((t, s, same))
    rows = []
    for (kind, cache, draft, k), members in groups.items():
        tokens = sum(len(s.tokens) for _, s, _ in members)
        proposed = sum(s.proposed for _, s, _ in members)
        accepted = sum(s.accepted for _, s, _ in members)
        rows.append(TaskRow(
            kind, cache, draft, k, len(members), tokens, proposed, accepted,
            accepted / proposed if proposed else float("nan"),
            sum(s.target_forwards for _, s, _ in members) / tokens,
            sum(t.plain_s for t, _, _ in members) / sum(s.seconds for _, s, _ in members),
            sum(same for _, _, same in members)))
    return tuple(rows)
