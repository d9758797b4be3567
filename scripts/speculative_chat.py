"""Speculative decoding on a chat model's own tasks: the whole table, one cache per run.

Two task sets ship with the package (`kvcache_cli/speculative/data/speculative_tasks.json`): `copy`,
whose replies copy from the prompt (add a docstring or type hints to a function, correct
a paragraph's grammar, replace a word in a story), and `other`, whose replies are new
text. Each task is rendered by the model's chat template; plain greedy decoding runs to
the end-of-turn token (or --cap), then every draft at every K generates exactly that many
tokens with the same cache and must give the same tokens. Per (set, draft, K):
acceptance (accepted / proposed draft tokens), the target's forwards per token (1.0 is
plain decoding) and the speed-up (plain greedy's seconds over speculation's, summed over
the set's tasks). Acceptance, forwards and identity are exact on any machine; the
speed-up needs a quiet one.

    python scripts/speculative_chat.py [-m smollm2] [--cache static] \\
        [--drafts lookup,layers:10,layers:20,layers:26] [--speculate 2,4] [--sets copy,other] \\
        [--cap 128] [--threads 2] [--json]

Bad input (a model without a chat template, a draft as deep as the target, a cache that
cannot roll back, an unknown task set) is one line, exit status 2, before the weights load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from kvcache_cli import numbers


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2")
    p.add_argument("--cache", default="static", help="the target's cache: any kind that rolls "
                   "back (static, paged, int8, ...)")
    p.add_argument("--drafts", default="lookup,layers:10,layers:20,layers:26")
    p.add_argument("--speculate", default="2,4", help="K values: most draft tokens a step")
    p.add_argument("--sets", default="copy,other")
    p.add_argument("--cap", default="128", help="most tokens in a reply")
    p.add_argument("--threads", default="2")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _checked(a: argparse.Namespace):
    """(draft specs, Ks, sets, cap, threads, tasks, stop ids); one line and exit 2 else."""
    from kvcache_cli.caches import CacheSpecError
    from kvcache_cli.models import model_config
    from kvcache_cli.speculative.decode import check_speculation
    from kvcache_cli.speculative.drafts import parse_draft
    from kvcache_cli.speculative.tasks import TASK_SETS, chat_tasks

    try:
        cap = numbers.whole(a.cap, "--cap", 1, 4096)
        threads = numbers.whole(a.threads, "--threads", 1, 1024)
        ks = [numbers.whole(k.strip(), "--speculate", 1, 64) for k in a.speculate.split(",")]
        sets = [s.strip() for s in a.sets.split(",") if s.strip()]
        bad = [s for s in sets if s not in TASK_SETS]
        if bad or not sets:
            raise ValueError(f"--sets {a.sets!r}: expected {' or '.join(TASK_SETS)}, "
                             "comma-separated")
        config = model_config(a.model)
        tasks = chat_tasks(config, a.model, sets)
        if not config.eos_ids:
            raise ValueError(f"model {a.model!r} names no end-of-turn token")
        longest = max(len(t.prompt_ids) for t in tasks) + cap
        if longest > config.context:
            raise ValueError(f"--cap {cap}: the longest task ({longest - cap} tokens) and its "
                             f"reply pass the context window {config.context}")
        specs = [parse_draft(d) for d in a.drafts.split(",")]
        for spec in specs:
            if spec.kind == "model":
                raise ValueError(f"draft {spec}: expected lookup[:n] or layers:N (this table "
                                 "measures drafts that need no second model)")
            check_speculation(config, spec, None, ks, a.cache, positions=longest)
    except (ValueError, CacheSpecError) as err:  # NumberError and RollbackError are both
        _fail(str(err))
    return specs, ks, sets, cap, threads, tasks, tuple(config.eos_ids)


def main(argv=None) -> None:
    a = _args(argv)
    specs, ks, sets, cap, threads, tasks, stop_ids = _checked(a)
    import torch

    from kvcache_cli import models
    from kvcache_cli.speculative.drafts import make_draft
    from kvcache_cli.speculative.tasks import TaskTable, run_task, task_rows

    torch.set_num_threads(threads)
    model = models.load_model(a.model, "auto", "cpu", torch.float32).model
    max_len = max(len(t.prompt_ids) for t in tasks) + cap + max(ks) + 1
    drafts = [make_draft(s, model, max_len) for s in specs]
    runs = []
    for t in tasks:
        runs.append(run_task(model, t, drafts, ks, a.cache, cap, stop_ids))
        print(f"{t.kind} {t.index}: {runs[-1].reply_tokens} tokens", file=sys.stderr)
    table = TaskTable(a.model, cap, torch.get_num_threads(), tuple(runs), task_rows(runs))
    if a.json:
        print(json.dumps(dataclasses.asdict(table), indent=1, default=str))
        return
    _print(table, a.cache)


def _print(t, cache: str) -> None:  # t: speculative.TaskTable
    print(f"{t.model}, cache {cache}, {t.threads} threads, replies to the end of turn or "
          f"{t.cap} tokens, greedy")
    for r in t.runs:
        end = "end of turn" if r.stopped else "cap"
        print(f"  task {r.kind} {r.index}: prompt {r.prompt_tokens}, reply {r.reply_tokens} "
              f"tokens ({end}), plain {r.reply_tokens / r.plain_s:.1f} tok/s")
    print(f"{'set':6} {'draft':10} {'K':>2} {'tokens':>6} {'accept':>7} {'fwd/tok':>7} "
          f"{'speed':>6} {'= greedy':>8}")
    for w in t.rows:
        acc = "-" if math.isnan(w.acceptance) else f"{w.acceptance:.1%}"
        print(f"{w.kind:6} {w.draft:10} {w.k:>2} {w.tokens:>6} {acc:>7} "
              f"{w.forwards_per_token:>7.3f} {w.speedup:>5.2f}x {w.identical:>4}/{w.tasks}")
    print("every run gave plain greedy's tokens" if t.all_identical
          else "SOME RUNS LEFT PLAIN GREEDY'S TOKENS: a bug")


if __name__ == "__main__":
    main()
