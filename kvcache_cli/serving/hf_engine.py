"""transformers' continuous batching (`generate_batch`'s manager) as a serving engine
beside ours: the same requests, the same clock, its own paged cache."""

from __future__ import annotations

from kvcache_cli.models.base import FamilyModel
from kvcache_cli.serving.plan import Plan, warmup_request
from kvcache_cli.serving.recorder import Recorder
from kvcache_cli.serving.workload import WorkloadSpec


def hf_manager(model: FamilyModel, plan: Plan, block_size: int, max_batch: int, spec: WorkloadSpec,
                prefix_sharing: bool):
    """transformers' continuous-batching manager on our weights, started and warmed up."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcache_cli.models import to_hf

    hf = to_hf(model)
    hf.generation_config.eos_token_id = None  # ours never stop early; neither may it
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=spec.output_len[1])
    batching = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=plan.n_blocks,  # the same memory as our pool
        max_requests_per_batch=max_batch,
        allow_block_sharing=prefix_sharing,  # its prefix caching, on or off as ours is
        # Tokens one forward may take: a whole prompt, as our prefill does.
        max_batch_tokens=max(spec.shared_prefix + spec.prompt_len[1], max_batch),
    )
    manager = hf.init_continuous_batching(generation, batching)
    manager.warmup()
    manager.start()
    hf_collect(manager, [warmup_request(plan.slab_len)], None)
    return manager


def hf_collect(manager, requests, rec: Recorder | None) -> None:
    """Hand requests in at their arrival times; wait for every result."""
    pending = {}
    added = 0
    while added < len(requests) or pending:
        if rec is None:
            due = requests[added:]
        else:
            due = list(rec.arrivals())
        for r in due:
            # -1: no stop (transformers' "disabled"), so a random-ids reply runs to its count.
            stop = list(r.stop_ids) if r.stop_ids else -1
            pending[manager.add_request(list(r.prompt), request_id=f"r{r.id}",
                                        max_new_tokens=r.max_new_tokens,
                                        record_timestamps=True, eos_token_id=stop)] = r
        added += len(due)
        result = manager.get_result(timeout=0.01 if added < len(requests) else 1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' batching thread stopped before finishing")
            continue
        if not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"transformers' generate_batch failed: {result.error}")
        r = pending.pop(result.request_id)
        if rec is not None:
            rec.tokens[r.id] = list(result.generated_tokens)
            # One time per token when it keeps them; else the finish for every token.
            stamps = list(result.timestamps or [])
            if len(stamps) != len(result.generated_tokens):
                stamps = [result.lifespan[1]] * len(result.generated_tokens)
            rec.times[r.id] = [t - rec.t0 for t in stamps]
            rec.done(r.id, stamps[-1] - rec.t0)
            if rec.progress is not None:
                rec.progress(rec.engine, len(rec.finish), len(rec.requests), 0, 0, 0, 0)
