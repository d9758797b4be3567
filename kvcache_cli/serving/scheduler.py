"""What runs each step, under one of two policies. No tensors here.

`prefill-first` (nano-vllm's): a step is either a prefill (every waiting request
that fits, in arrival order, up to `max_batch` running, each prompt computed whole
in a forward of its own) or a decode of every running sequence. While prompts run,
every running sequence waits: its next token is late by the whole prefill.

`decode-first` (vLLM V1's, Sarathi-Serve's stall-free batches): there is no prefill
or decode phase. Each step fills one forward of at most `token_budget` tokens:
first one token for every running sequence past its prompt, then chunks of the
prompts part-way through (oldest first), then new requests while blocks are free
and the budget lasts. A long prompt spans several steps; short ones share one. New
requests are admitted only in a step that preempted nothing (vLLM's rule).

Either way a sequence gets blocks for all its tokens when admitted, and a decode
that needs a block when none is free preempts the sequence admitted last: its blocks
go back to the pool and it waits at the head of the queue, to be recomputed from
its tokens (vLLM's recompute preemption), chunk by chunk under decode-first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.sequence import Sequence, Status

POLICIES = ("prefill-first", "decode-first")


@dataclass(frozen=True)
class Chunk:
    """Tokens start .. start+length-1 of a sequence, computed in one forward."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """Whether it reaches the sequence's last token: its logits choose the next one."""
        return self.start + self.length == len(self.seq.tokens)


@dataclass(frozen=True)
class Step:
    prefill: tuple[Sequence, ...] = ()  # prefill-first: each prefilled on its own
    decode: tuple[Sequence, ...] = ()  # prefill-first: all in one batched forward
    chunks: tuple[Chunk, ...] = ()  # decode-first: decodes, then prompt chunks, one forward
    # Counted when scheduled (the sequences move on as the step runs):
    prompt_tokens: int = 0  # prompt tokens computed, recomputations included
    decode_tokens: int = 0  # one per sequence past its prompt
    # Sequence-forwards: per forward computing prompt tokens, the sequences ready to
    # decode that it keeps waiting (decode-first: none, decodes ride in every forward).
    stalled: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.chunks)


def parse_policy(text: str) -> tuple[str, ...]:
    """`"prefill-first,decode-first"` -> both, checked."""
    names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        what = f"unknown policy {', '.join(map(repr, unknown))}" if unknown else "no policy"
        raise ValueError(f"--policy: {what}; valid policies: {', '.join(POLICIES)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--policy {text!r}: a policy given twice")
    return names


# A forward of a million tokens is no run a host can do; past it the number is a slip.
MAX_TOKEN_BUDGET = 1 << 20


def check_budget(budget: int, block_size: int) -> None:
    if budget < block_size:
        raise ValueError(f"--token-budget {budget:,}: expected at least one block "
                         f"({block_size:,} tokens), the --block-size")
    if budget > MAX_TOKEN_BUDGET:
        raise ValueError(f"--token-budget {budget:,}: expected tokens per forward "
                         f"from {block_size:,} (one block) to {MAX_TOKEN_BUDGET:,}")


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, policy: str = "prefill-first",
                 token_budget: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")
        if policy == "decode-first":
            if token_budget is None:
                raise ValueError("decode-first needs a token budget")
            check_budget(token_budget, blocks.block_size)
        self.blocks, self.max_batch = blocks, max_batch
        self.policy, self.token_budget = policy, token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the youngest last
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Step:
        if self.policy == "decode-first":
            return self._decode_first()
        return self._prefill_first()

    # -- prefill-first

    def _prefill_first(self) -> Step:
        admitted = []
        while self._admissible():
            admitted.append(self._admit(whole=True))
        if admitted:
            # Prompt k of n runs while the sequences that were decoding, and the k
            # prompts before it (each now ready for its second token), wait.
            ready, n = sum(1 for s in self.running if s.decoding), len(admitted)
            return Step(prefill=tuple(admitted), stalled=n * ready + n * (n - 1) // 2,
                        prompt_tokens=sum(s.to_compute for s in admitted))
        decode = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted by an older one just now
                continue
            if self._make_room(seq):
                decode.append(seq)
        return Step(decode=tuple(decode), decode_tokens=len(decode))

    # -- decode-first

    def _decode_first(self) -> Step:
        budget = self.token_budget
        chunks: list[Chunk] = []
        preempted = self.preemptions
        for seq in list(self.running):  # decodes first, oldest first
            if budget == 0:
                break
            if seq.status is Status.RUNNING and seq.decoding and self._make_room(seq):
                chunks.append(Chunk(seq, seq.num_cached, 1))
                budget -= 1
        decodes = len(chunks)
        scheduled = {id(c.seq) for c in chunks}
        for seq in self.running:  # then prompts part-way through (recomputations too)
            if budget == 0:
                break
            if id(seq) not in scheduled and not seq.decoding:
                budget -= self._chunk(seq, budget, chunks)
        while budget > 0 and self.preemptions == preempted and self._admissible():
            budget -= self._chunk(self._admit(whole=False), budget, chunks)
        return Step(chunks=tuple(chunks), decode_tokens=decodes,
                    prompt_tokens=sum(c.length for c in chunks[decodes:]))

    def _chunk(self, seq: Sequence, budget: int, chunks: list[Chunk]) -> int:
        self.blocks.before_compute(seq)
        n = min(seq.to_compute, budget)
        chunks.append(Chunk(seq, seq.num_cached, n))
        self.blocks.register_full_blocks(seq, seq.num_cached + n)
        return n

    # -- shared

    def _admissible(self) -> bool:
        return bool(self.waiting and len(self.running) < self.max_batch
                    and self.blocks.can_allocate(self.waiting[0]))

    def _admit(self, whole: bool) -> Sequence:
        seq = self.waiting.popleft()
        self.blocks.allocate(seq, whole=whole)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return seq

    def _make_room(self, seq: Sequence) -> bool:
        """A slot for seq's next token, preempting the youngest until there is one;
        False when seq itself was the youngest and went."""
        self.blocks.before_compute(seq)
        while not self.blocks.can_append(seq):
            self._preempt(self.running[-1])
            if seq.status is not Status.RUNNING:
                return False
        self.blocks.append_slot(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = Status.FINISHED
