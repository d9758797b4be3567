"""Generation with any family's model: prefill, decode, the naive loop and every cache.

Modes: `naive` runs the full forward over the whole sequence for every token;
`concat` and `static` prefill the prompt once and then decode one token per forward
against a cache (`caches.ConcatCache`, `caches.StaticCache`). All three pick the same
greedy tokens (the breaks, in `breaks/`, change one call of this loop).
Reference: the GPT-2 KV-cache article in `seeds/003_*`, section 5.
"""

from __future__ import annotations

import ctypes
import time
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from operator import is_, itemgetter

import torch
from torch import Tensor

from kvcache_cli.caches import MODES, CacheSpec, KVCache, make_cache
from kvcache_cli.caches.step import Step
from kvcache_cli.models.base import FamilyConfig, FamilyModel

# A step's forward: (tokens (B, T), start_pos, cache, **options) -> logits (B, T', vocab),
# GPT.forward itself or a broken stand-in for it.
Forward = Callable[..., Tensor]

# ---------------------------------------------------------------------------- checks


def check_mode(spec: str | CacheSpec) -> None:
    """A spec is `naive` (no cache: every position recomputed) or a cache spec: parsed (a
    `CacheSpec`, as the CLI passes it) or its text (`static`, `concat`, `paged:b16`, ...: see
    caches.spec); anything else is a ValueError."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_spec

    if spec == "naive" or isinstance(spec, CacheSpec):
        return
    try:
        parse_cache_spec(str(spec))
    except CacheSpecError as err:
        raise ValueError(f"unknown mode {str(spec)!r}: expected {', '.join(MODES)} or a cache "
                         f"spec ({err})") from None


def check_request(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuse, before any work, a request the model cannot serve."""
    check_request_config(model.config, prompt_ids, max_new_tokens)


def check_request_config(config: FamilyConfig, prompt_ids: list[int], max_new_tokens: int
                         ) -> None:
    """`check_request` from the model's config alone: callable before the weights load."""
    if not prompt_ids:
        raise ValueError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: expected at least 1")
    V, window = config.vocab_size, config.context
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary 0..{V - 1}")
    last = len(prompt_ids) + max_new_tokens - 1  # the position of the last new token
    if last >= window:
        raise IndexError(
            f"position {last} past context window {window}: a {len(prompt_ids)}-token prompt "
            f"+ {max_new_tokens} new tokens needs {last + 1} positions"
        )


# ---------------------------------------------------------------------------- steps


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from last-position logits (B, vocab); temperature 0 is greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = probabilities(logits.float(), temperature, top_k)  # (B, vocab)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def probabilities(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """Logits (n, vocab) -> the distribution (n, vocab) sampling draws from, in the logits'
    dtype: scaled by 1 / temperature, all but the top_k most likely masked out."""
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (n, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


# On a generator, inference_mode holds while the generator runs, not while its caller does.
@torch.inference_mode()
def token_steps(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: str,
    cache: KVCache | None,
    choose: Callable[[Tensor], Tensor],
    forward: Forward | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """(token, the logits it was chosen from) per step; the loop behind every mode."""
    forward = forward if forward is not None else model
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # (1, T)
    P = idx.size(1)
    if spec == "naive":
        for i in range(max_new_tokens):
            # No cache: the whole sequence goes through the model again, every step.
            logits = forward(idx, 0, None, last_only=True)[:, -1]  # (1, vocab)
            nxt = choose(logits)  # (1,)
            yield int(nxt.item()), logits  # .item() waits for the device: the sync point
            if i + 1 < max_new_tokens:
                idx = torch.cat([idx, nxt.view(1, 1)], dim=1)  # (1, T + 1)
        return
    logits = forward(idx, 0, cache, last_only=True)[:, -1]  # (1, vocab): the prefill
    for i in range(max_new_tokens):
        nxt = choose(logits)  # (1,)
        yield int(nxt.item()), logits
        if i + 1 < max_new_tokens:  # the last token is never fed back
            # Decode: one token at position P + i, attending over the cache.
            logits = forward(nxt.view(1, 1), P + i, cache, last_only=True)[:, -1]


class CompiledDecode:
    """One decode step compiled whole, as gpt-fast compiles it; the prefill runs eager.

    The step is one graph at every position, so it compiles once and never breaks:
    the cache is static and read whole (`StaticCache(whole=True)`: one shape at every
    step; a sliding layer's ring, `RingCache(whole=True)`, every slot under the mask of
    the positions it holds), the position enters as a tensor, never as a Python int (an
    int is a guard, and each new value a recompile), and nothing inside the graph reads
    or writes a Python number: the cache records each write after the graph
    (`advance`). The step is the model's own forward, with a `Step` whose position is a
    tensor (the cache then writes with `write_at` / `attend_at`), so every family
    compiles the same way. Called as a `Forward`; T > 1 tokens (the prefill) go to the
    eager model. On CUDA the caches' buffers are marked as static addresses, so the step
    (mode "reduce-overhead") replays as one CUDA graph.
    """

    def __init__(self, model: FamilyModel, mode: str = "default"):
        from kvcache_cli.models.linear import pin_threads

        self.model = pin_threads(model)
        self.step = torch.compile(_decode_step, mode=mode, fullgraph=True, dynamic=False)

    def __call__(self, idx: Tensor, start_pos: int, cache: KVCache | None,
                 last_only: bool = False) -> Tensor:
        if idx.size(1) > 1:
            return self.model(idx, start_pos, cache, last_only=last_only)
        if cache is None or not cache.whole or not hasattr(cache, "advance"):
            raise ValueError("a compiled decode step reads a static cache whole (and a "
                             "sliding layer's ring): make_cache('static', ..., whole=True)")
        pos = torch.tensor([start_pos], device=idx.device)  # (1,): the position as data
        logits = self.step(self.model, idx, Step(pos, pos), cache)  # (B, 1, vocab)
        cache.advance(start_pos, 1)
        return logits


class ReplayedDecode:
    """A decode step's native calls recorded once and run again, without the Python
    between them: the CPU's answer to a CUDA graph.

    On a decode's float32 rows a step of the Llama family (SmolLM2, Gemma 3) is native
    calls alone: the products, the fused norms, rotation, adds and embedding scale, and the
    attention (`models.fused`, `caches.code_attention.attend_decode`), nine or ten a layer,
    and the Python that makes them costs as much as several of its products. This forward
    records a step's calls (`caches.native.recorded`) and the torch ops it dispatches
    (allocations, views and the embedding's lookup may run, nothing else), then records a
    second step at the next position (and a third, where the first did what later ones do
    not: a kernel built, or a memo made with a torch op, on first use); where two in a row
    made the same calls on the same memory, each fresh buffer named by its order of
    allocation and the cache's by its place (`KVCache.buffers`), the first step's calls
    serve every later position of any cache of that kind and shape. A replay looks the
    token's embedding up into the buffer the first call reads, writes the position where
    the calls read it (the step's positions: the rotation and the attention read them from
    memory), records the write in the cache (`advance`), and makes the calls; a call's
    arguments in a struct are copied as recorded, pointers named alike. A step that is not
    native calls alone (a cache without fixed buffers: a window with sinks, the fp8 and
    rotated integer kinds, an integer cache whose sinks are filling; half-precision
    activations; GPT-2's torch blocks; a GPU) runs eager, and
    `why_not` says why. Called as a `Forward`; T > 1 tokens (the prefill) go to the eager
    model. The recorded calls point at the model's weights: one is made for a model whose
    weights stay as they are (a change of `--weights-dtype` makes a new one, as `bench` and
    `generate` do).
    """

    def __init__(self, model: FamilyModel):
        self.model = model
        self.pos = torch.zeros(1, dtype=torch.long, device=model.device)  # what the calls read
        self.why_not: str | None = None  # why the step runs eager, once a capture failed
        self._key: tuple | None = None  # what the capture or plan below was made for
        self._first: _Recorded | None = None  # a step recorded, before a second confirms it
        self._plan: _Plan | None = None
        self._recordings = 0  # steps recorded for the key
        self.steps_replayed = 0

    def __call__(self, idx: Tensor, start_pos: int, cache: KVCache | None,
                 last_only: bool = False) -> Tensor:
        if idx.size(1) > 1 or cache is None:
            return self.model(idx, start_pos, cache, last_only=last_only)
        buffers = cache.buffers()
        if buffers is None:  # its decoding step's calls would move with the position
            self._refuse(f"a {type(cache).__name__} has no fixed buffers to replay a step "
                         "over (static, fp16/bf16 and unrotated integer caches and plain "
                         "sliding windows do)")
            return self.model(idx, start_pos, cache, last_only=last_only)
        context = self.model.config.context
        if not 0 <= start_pos < context:
            raise IndexError(f"position {start_pos} past context window {context}")
        settings = (idx.size(0), last_only, torch.get_num_threads(), torch.is_grad_enabled())
        # a plan whose calls point at these very buffers needs no new key: the same objects
        # have the same shapes (some 300 of them for an integer cache)
        if self._plan is None or settings != self._key[2:] or not self._plan.serves(cache,
                                                                                     buffers):
            key = (type(cache), [(t.shape, t.dtype) for t in buffers], *settings)
            if key != self._key:
                self._key, self._first, self._plan, self.why_not = key, None, None, None
                self._recordings = 0
        if self._plan is not None:
            logits = self._plan.run(idx, start_pos, cache, buffers)
            self.steps_replayed += 1
            return logits
        self.pos.fill_(start_pos)
        step = Step(start_pos, self.pos)
        if self.why_not is not None:
            return self.model(idx, step, cache, last_only=last_only)
        recorded = _Recorded.of(self.model, idx, step, cache, buffers, last_only)
        self._recordings += 1
        why = recorded.refused
        if why is None and self._first is not None:
            why = self._first.differs(recorded)
            if why is None:  # two steps in a row alike: the first's calls serve every one
                self._plan, self._first = _Plan(self._first, self.pos), None
                return recorded.logits.clone()  # the plan's calls write these again
        if self._recordings < RECORDINGS:
            # a first step may do what later ones do not (build a kernel on first use,
            # make a memo with a torch op): the next pair is compared
            self._first = recorded if recorded.refused is None else None
        else:
            self._refuse(why or "no two steps in a row could be recorded")
        return recorded.logits.clone()  # a plan's calls write these again

    def _refuse(self, why: str) -> None:
        """Run eager from now on, and say why once."""
        self.why_not = why
        line = f"decode steps not replayed: {why}"
        if REPLAY_NOTE[-1:] != [line]:  # once, however many generations met it
            REPLAY_NOTE.append(line)


REPLAY_NOTE: list[str] = []  # why a `ReplayedDecode` ran its steps eager, once found
RECORDINGS = 3  # steps a `ReplayedDecode` records, at most, to find two alike in a row

# The torch ops a replayed step may dispatch: fresh buffers for the native calls' outputs,
# and the token's embedding, looked up again at each replay; views cost nothing and run too.
_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default)
_LOOKUP = torch.ops.aten.embedding.default


@dataclass
class _Recorded:
    """One decode step as it ran: the native calls, their pointers named (`_named`), the
    fresh tensors they point into (kept alive), the embedding looked up, the logits."""

    calls: list[tuple[Callable, tuple]]
    ops: list[str]  # every torch op dispatched, by name
    fresh: list[Tensor]  # every tensor the step allocated, in order
    lookup: tuple[Tensor, int] | None  # (the embedding's weight, its output's place in fresh)
    logits: Tensor
    refused: str | None  # the op that makes the step not native calls alone
    named: list[tuple]  # the calls' arguments, each pointer named by what it points into

    @classmethod
    def of(cls, model: FamilyModel, idx: Tensor, step: Step, cache: KVCache,
           buffers: list[Tensor], last_only: bool) -> _Recorded:
        """The step at `step` recorded; `buffers`: the cache's (`KVCache.buffers`) before it."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from kvcache_cli.caches import native

        ops: list[str] = []
        fresh: list[Tensor] = []
        lookup: list[tuple[Tensor, int]] = []
        refused: list[str] = []

        class StepOps(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # No compiled code runs under this mode; torch would otherwise wrap
                # __torch_dispatch__ in its dynamo guard, whose first call imports
                # torch._dynamo (seconds of a one-shot `generate`'s first decode step)
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                ops.append(str(func))
                if func in _ALLOCATIONS or (func is _LOOKUP and not lookup):
                    if func is _LOOKUP:
                        lookup.append((args[0], len(fresh)))
                    fresh.append(out)
                elif not func.is_view and not refused:
                    refused.append(f"the step runs torch's {func} (not a native call)")
                return out

        calls: list[tuple[Callable, tuple]] = []
        with native.recorded(calls), StepOps():
            logits = model(idx, step, cache, last_only=last_only)
        if not calls:
            refused.append("the step makes no native call (its kernels cannot run here)")
        recorded = cls(calls, ops, fresh, lookup[0] if lookup else None, logits,
                       refused[0] if refused else None, [])
        places = recorded.places(buffers, step.pos)
        recorded.named = [_named(args, places) for _, args in calls]
        if recorded.lookup is None and recorded.refused is None:
            recorded.refused = "the step looks up no embedding to replay"
        return recorded

    def places(self, buffers: list[Tensor], pos: Tensor) -> _Places:
        """The memory a call may point into: this step's fresh tensors, the cache's buffers
        and the position."""
        held = [(t, ("fresh", i)) for i, t in enumerate(self.fresh)]
        held += [(t, ("cache", i)) for i, t in enumerate(buffers)]
        return _Places([(t.data_ptr(), t.data_ptr() + t.nbytes, name)
                        for t, name in [*held, (pos, ("pos",))] if t.nbytes])

    def differs(self, other: _Recorded) -> str | None:
        """Why this step's calls would not serve `other`'s position, or None: the same ops
        and the same calls on the same named memory."""
        if self.ops != other.ops:
            return "two steps dispatched different torch ops"
        if [f for f, _ in self.calls] != [f for f, _ in other.calls]:
            return "two steps made different native calls"
        for (function, _), mine, theirs in zip(self.calls, self.named, other.named,
                                              strict=True):
            if mine != theirs:
                return (f"two steps called {function.__name__} with different arguments "
                        "(a number that moves with the position)")
        return None


_BYREF = type(ctypes.byref(ctypes.c_int()))  # a ctypes.byref's argument object


class _Places:
    """(first byte, end, name) of tensors that share no byte (each its own allocation),
    found by address in a sorted list: a step's calls pass some 3,000 pointers, each looked
    for among some 400 tensors."""

    def __init__(self, places: list[tuple[int, int, tuple]]):
        self.places = sorted(places, key=itemgetter(0))
        self.firsts = [first for first, _, _ in self.places]

    def find(self, address: int) -> tuple | None:
        """(name..., offset) of the tensor holding `address`, or None."""
        i = bisect_right(self.firsts, address) - 1
        if i >= 0:
            first, end, what = self.places[i]
            if address < end:
                return (*what, address - first)
        return None


def _named(args: tuple, places: _Places) -> tuple:
    """args with each pointer into a fresh tensor, the cache or the position replaced by
    (its name, offset); other numbers, and pointers into the model's weights, as they are.
    A struct passed by reference (a call's arguments in one, `code_attention.DecodeArgs`) is
    named by its fields as they are now, ("struct", its type, the fields named): the caller
    rewrites its struct at every eager step, and a replay makes its own."""
    def name(arg):
        if isinstance(arg, int) and not isinstance(arg, bool):
            return places.find(arg) or arg
        if isinstance(arg, _BYREF) and isinstance(arg._obj, ctypes.Structure):
            struct = arg._obj
            return ("struct", type(struct),
                    tuple(name(getattr(struct, field)) for field, _ in struct._fields_))
        return arg
    return tuple(name(arg) for arg in args)


class _Plan:
    """A recorded step's calls, ready to run again on any cache of its kind and shape."""

    def __init__(self, recorded: _Recorded, pos: Tensor):
        self.recorded, self.pos = recorded, pos
        self.weight, at = recorded.lookup  # the embedding's weight, and where its row goes
        self.embedded = recorded.fresh[at]  # (B, 1, C)
        self.cache: KVCache | None = None  # what `calls` were resolved for
        self.buffers: list[Tensor] = []  # ... and its buffers then
        self.calls: list[tuple[Callable, tuple]] = []

    def serves(self, cache: KVCache, buffers: list[Tensor]) -> bool:
        """Whether the calls point at these buffers of this cache, as they are resolved."""
        return cache is self.cache and len(buffers) == len(self.buffers) and \
            all(map(is_, buffers, self.buffers))

    def run(self, idx: Tensor, start_pos: int, cache: KVCache, buffers: list[Tensor]) -> Tensor:
        # a cache may give a buffer back for another of its shape (a quantised cache's tail
        # after a prefill): the calls then point at the new one
        if not self.serves(cache, buffers):
            self.cache, self.buffers, self.calls = cache, buffers, self._resolved(buffers)
        cache.advance(start_pos, 1)  # refused past the cache's slots, before any write
        self.pos.fill_(start_pos)
        torch.index_select(self.weight, 0, idx.view(-1),
                           out=self.embedded.view(idx.numel(), -1))  # (B, C)
        for function, args in self.calls:
            function(*args)
        # the recorded step's logits, a view of one of its fresh tensors, written again
        return self.recorded.logits.clone()

    def _resolved(self, held: list[Tensor]) -> list[tuple[Callable, tuple]]:
        """The calls with each named pointer made an address again, the cache's into its
        buffers `held`, and each named struct made afresh (kept alive by its reference)."""
        fresh = [t.data_ptr() for t in self.recorded.fresh]
        buffers = [t.data_ptr() for t in held]

        def address(arg):
            if not isinstance(arg, tuple):
                return arg
            if arg[0] == "struct":
                return ctypes.byref(arg[1](*map(address, arg[2])))
            if arg[0] == "fresh":
                return fresh[arg[1]] + arg[2]
            if arg[0] == "cache":
                return buffers[arg[1]] + arg[2]
            return self.pos.data_ptr() + arg[1]
        return [(function, tuple(address(a) for a in named))
                for (function, _), named in zip(self.recorded.calls, self.recorded.named,
                                                strict=True)]


def _decode_step(model: FamilyModel, idx: Tensor, step: Step, cache: KVCache) -> Tensor:
    """Logits (B, T, vocab) of tokens idx (B, T) at positions step.pos (T,), every row at
    the same positions, written into and read from a whole static cache."""
    return model(idx, step, cache)


def stream_tokens(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: str | CacheSpec,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    cache: KVCache | None = None,
    forward: Forward | None = None,
) -> Iterator[int]:
    """Yield each new token id as soon as it is chosen.

    The first yield comes right after the prefill (time to first token), each later
    one after one decode step. Checks run now, before the first `next()`. Without a
    `cache`, a fresh one is made for the request (sized prompt + new tokens for
    `static`); pass one to read its `bytes_copied` afterwards. `forward` stands in for
    the model's own (a `CompiledDecode`).
    """
    _check_generation(model, prompt_ids, max_new_tokens, spec, temperature, top_k)
    if spec == "naive" and cache is not None:
        raise ValueError("mode naive uses no cache")
    if spec != "naive" and cache is None:
        cache = make_cache(spec, model, len(prompt_ids) + max_new_tokens)
    return _tokens(model, prompt_ids, max_new_tokens, spec, cache,
                   temperature, top_k, generator, forward)


def _check_generation(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int,
                      spec: str | CacheSpec, temperature: float, top_k: int | None) -> None:
    """Every check of a request, once per call of `stream_tokens` or `generate`."""
    check_mode(spec)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    check_request(model, prompt_ids, max_new_tokens)


def _tokens(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int,
            spec: str | CacheSpec, cache: KVCache | None, temperature: float,
            top_k: int | None, generator: torch.Generator | None,
            forward: Forward | None) -> Iterator[int]:
    """The new token ids of a checked request, one per step."""

    def choose(logits: Tensor) -> Tensor:
        return sample(logits, temperature, top_k, generator)

    steps = token_steps(model, list(prompt_ids), max_new_tokens, spec, cache, choose, forward)
    return map(itemgetter(0), steps)  # the tokens, the logits dropped


@dataclass(frozen=True)
class Generation:
    mode: str
    device: str
    dtype: str
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]  # the new tokens only
    first_token_s: float  # prefill + first token: time to first token
    decode_s: float  # the remaining len(tokens) - 1 tokens, one forward each
    decode_tokens_per_s: float  # nan when only one token was asked for
    cache_bytes_held: int  # 0 for naive
    cache_bytes_copied: int
    stopped: bool = False  # ended at a stop token (a chat reply's end of turn), not the count
    steps_replayed: int = 0  # decode steps made by a recorded step's calls (`ReplayedDecode`)


def generate(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: str | CacheSpec = "static",
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[int], None] | None = None,
    stop_ids: Collection[int] = (),
) -> Generation:
    """Run one request to the end; `on_token` sees each token as it is made. `spec` is one
    of MODES or any cache spec (`paged:b16`, ...). A token in `stop_ids` (a chat model's
    end of turn) is the last one made. On the CPU the decode steps are replayed
    (`ReplayedDecode`) wherever the cache has fixed buffers (static, fp16, bf16, int8/int4/
    int2 unrotated once their sinks are full, a plain window): the eager steps' tokens and
    logits, without their Python."""
    # Before sizing a cache for it.
    _check_generation(model, prompt_ids, max_new_tokens, spec, temperature, top_k)
    cache = make_cache(spec, model, len(prompt_ids) + max_new_tokens)
    # a cache may have fixed buffers only from some step on (an integer cache's sinks
    # filling): the replay runs the steps before it eager
    replayed = ReplayedDecode(model) if cache is not None and model.device.type == "cpu" \
        else None
    stream = _tokens(model, prompt_ids, max_new_tokens, spec, cache,
                     temperature, top_k, generator, replayed)
    tokens: list[int] = []
    start = time.perf_counter()
    first, outside = start, 0.0  # outside: time spent in on_token, not generating
    for token in stream:
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        if on_token is not None:
            before = time.perf_counter()
            on_token(token)
            outside += time.perf_counter() - before
        if token in stop_ids:
            break
    decode_s = time.perf_counter() - first - outside
    n_decoded = len(tokens) - 1
    return Generation(
        mode=str(spec),
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        prompt_ids=tuple(prompt_ids),
        tokens=tuple(tokens),
        first_token_s=first - start,
        decode_s=decode_s,
        decode_tokens_per_s=n_decoded / decode_s if n_decoded else float("nan"),
        cache_bytes_held=cache.bytes_held if cache is not None else 0,
        cache_bytes_copied=cache.bytes_copied if cache is not None else 0,
        stopped=bool(tokens) and tokens[-1] in stop_ids,
        steps_replayed=0 if replayed is None else replayed.steps_replayed,
    )


