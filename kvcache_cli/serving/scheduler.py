"""What runs each step: admit waiting requests while blocks are free, else decode
every running one, preempting the youngest when the pool runs out.

nano-vllm's scheduler: a step is either a prefill (every waiting request that fits,
in arrival order, up to `max_batch` running) or a decode of every running sequence.
A decode that needs a block when none is free preempts the sequence admitted last:
its blocks go back to the pool and it waits at the head of the queue, to be
recomputed from its tokens (vLLM's recompute preemption). No tensors here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.sequence import Sequence, Status


@dataclass(frozen=True)
class Step:
    prefill: tuple[Sequence, ...]  # each prefilled on its own
    decode: tuple[Sequence, ...]  # all in one batched forward


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int):
        self.blocks, self.max_batch = blocks, max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the youngest last
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Step:
        admitted = []
        while (self.waiting and len(self.running) < self.max_batch
               and self.blocks.can_allocate(self.waiting[0])):
            seq = self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        if admitted:
            return Step(tuple(admitted), ())
        decode = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted by an older one just now
                continue
            while not self.blocks.can_append(seq):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            else:
                self.blocks.append_slot(seq)
                decode.append(seq)
        return Step((), tuple(decode))

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
