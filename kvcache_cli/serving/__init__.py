"""Many sequences at once: a paged KV cache and continuous batching for GPT-2.

vLLM's engine in nano-vllm's split, one job a module: `sequence` (a request and its
state), `block_manager` (the pool's free list, reference counts and prefix hashes;
no tensors), `scheduler`
(what runs each step: admit, decode, preempt; no tensors), `model_runner` (a step's
batch as tensors through the model), `engines` (the loop, and the engines it is
measured against), `workload` (the seeded requests), `chat` (requests made by a chat
model's template, one system prompt shared), `gqa_pool` (the scheduler replayed at each
model's bytes a token) and `batching` (decode time against batch size, beside the
roofline). The pool itself is
`kvcache_cli.caches.paged.PagedCache`, one more cache kind. The NumPy `paged` demo in
`kv_cache_from_scratch.py` simulates the same allocator; the names follow it.
"""
