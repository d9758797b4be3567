"""Train a small byte-level GPT-2 on the Python standard library's own sources.

Quality measured on random weights means nothing, and pretrained GPT-2 cannot be
fetched offline, so the project ships a small model trained on text every machine has:
the top-level `*.py` files of the standard library, read as UTF-8 bytes (256 token ids,
no tokenizer to download). Every 16th file in sorted order is held out; their text is
the evaluation text (`heldout.txt` beside the checkpoint), never trained on.

Two kinds of sequence train it (their gradients added when a step has both):
- short windows at a random first position in [0, block_size - short_len], so every
  learned position embedding gets gradient at a sample-diverse price;
- every few steps, full windows of block_size tokens from position 0, so attention
  across the whole context (copying a name seen 1,500 bytes back) is learned, and the
  first position is always the start of a sequence (an attention sink may form there,
  as in real models).

Everything is seeded, runs on the CPU in float32 with torch only, and writes a Hugging
Face GPT-2 checkpoint (`config.json` + `model.safetensors`, Conv1D weights (in, out)) that
`gpt2.load_gpt2` reads like any other. `scripts/train_checkpoint.py` is the front end.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.models.gpt2 import _CONV1D, GPT, GPTConfig

HELDOUT_EVERY = 16  # files 0, 16, 32, ... of the sorted list are held out


@dataclass(frozen=True)
class Recipe:
    n_layer: int = 4
    n_head: int = 3  # head size 64, as every GPT-2 size has
    n_embd: int = 192
    block_size: int = 2048  # eval reads 2,000 cached tokens, so every position must be trained
    steps: int = 1000
    short_len: int = 256  # short windows, at a random first position
    short_batch: int = 8
    # Full block_size windows from position 0, every long_every-th step: on the CPU their
    # attention costs several times what the same bytes in short windows do.
    long_batch: int = 1
    long_every: int = 4
    lr: float = 4e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_tokens: int = 4096  # held-out bytes scored at each eval, in block_size windows
    seed: int = 0
    # One thread: on 2 cores shared with other work, a second OpenMP thread mostly waits
    # for the first (3-4x slower per step than alone when the cores are busy).
    threads: int = 1

    def config(self) -> GPTConfig:
        return GPTConfig(block_size=self.block_size, vocab_size=256, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, tokenizer="bytes")


# ---------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Corpus:
    train: Tensor  # (N,) uint8: the training files' bytes, concatenated
    heldout: bytes  # the held-out files' bytes, concatenated
    files: tuple[dict, ...]  # name, bytes, sha256, split: what was read, to reproduce it


def stdlib_corpus(root: Path | None = None) -> Corpus:
    """The standard library's top-level .py files, sorted by name; every 16th held out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py"), key=lambda p: p.name)
    if len(paths) < 2 * HELDOUT_EVERY:
        raise ValueError(f"{root}: {len(paths)} .py files; expected the standard library's")
    train, heldout, files = [], [], []
    for i, path in enumerate(paths):
        data = path.read_bytes()
        split = "heldout" if i % HELDOUT_EVERY == 0 else "train"
        (heldout if split == "heldout" else train).append(data)
        files.append(dict(name=path.name, bytes=len(data),
                          sha256=hashlib.sha256(data).hexdigest(), split=split))
    stream = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8)  # (N,)
    return Corpus(stream, b"".join(heldout), tuple(files))


# ---------------------------------------------------------------------------- batches


def _windows(stream: Tensor, batch: int, length: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """`batch` random windows of the stream: inputs and their next bytes, (B, length) each."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=g)
    rows = torch.stack([stream[s:s + length + 1] for s in starts.tolist()]).long()  # (B, L+1)
    return rows[:, :-1], rows[:, 1:]


def _lr(recipe: Recipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    done = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    floor = recipe.lr * recipe.min_lr_ratio
    return floor + (recipe.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


# ---------------------------------------------------------------------------- loss


def bits_per_byte(model: GPT, ids: Tensor) -> float:
    """Mean next-byte loss in bits over ids (N,), scored in whole block_size windows.

    Each window starts at position 0 with no context before it, as `eval` starts a text.
    """
    window = model.config.block_size
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, window):
            chunk = ids[start:start + window + 1].long()
            if chunk.numel() < 2:
                break
            logits = model(chunk[None, :-1], 0)  # (1, T, 256)
            nats = F.cross_entropy(logits[0], chunk[1:], reduction="sum")
            total, count = total + nats.item(), count + chunk.numel() - 1
    return total / count / math.log(2)


# ---------------------------------------------------------------------------- training


@dataclass(frozen=True)
class CurvePoint:
    step: int
    tokens: int  # training bytes seen so far
    seconds: float
    lr: float
    train_bits: float  # mean training loss over the steps since the last point, bits/byte
    heldout_bits: float | None  # on the first eval_tokens held-out bytes


def train(
    recipe: Recipe,
    corpus: Corpus,
    on_point: Callable[[CurvePoint], None] = lambda point: None,
    init: GPT | None = None,
) -> tuple[GPT, tuple[CurvePoint, ...]]:
    """Train from the recipe's seed (or on from `init`'s weights); returns the model and
    its curve.

    Runs on torch's current thread count (the script sets `recipe.threads`).
    """
    config = recipe.config()
    if recipe.short_batch and recipe.short_len > config.block_size:
        raise ValueError(f"short_len {recipe.short_len} past block_size {config.block_size}")
    model = GPT(config, init_std=0.02, seed=recipe.seed)
    if init is not None:
        if init.config != config:
            raise ValueError(f"init's shape {init.config} is not the recipe's {config}")
        model.load_state_dict(init.state_dict())  # copied into (out, in) storage
    model.train()
    g = torch.Generator().manual_seed(recipe.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [dict(params=decay, weight_decay=recipe.weight_decay),
         dict(params=no_decay, weight_decay=0.0)],
        lr=recipe.lr, betas=(0.9, 0.95),
    )
    heldout = torch.frombuffer(bytearray(corpus.heldout[:recipe.eval_tokens + 1]),
                               dtype=torch.uint8)
    curve, tokens, since, n_since, t0 = [], 0, 0.0, 0, time.perf_counter()
    for step in range(recipe.steps):
        long_batch = recipe.long_batch if step % recipe.long_every == 0 else 0
        per_step = recipe.short_batch * recipe.short_len + long_batch * config.block_size
        lr = _lr(recipe, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        if recipe.short_batch:
            x, y = _windows(corpus.train, recipe.short_batch, recipe.short_len, g)
            first = int(torch.randint(0, config.block_size - recipe.short_len + 1, (1,),
                                      generator=g))
            loss = F.cross_entropy(model(x, first).flatten(0, 1), y.flatten())
            (loss * recipe.short_batch * recipe.short_len / per_step).backward()
            loss_sum += loss.item() * recipe.short_batch * recipe.short_len
        if long_batch:
            x, y = _windows(corpus.train, long_batch, config.block_size, g)
            loss = F.cross_entropy(model(x, 0).flatten(0, 1), y.flatten())
            (loss * long_batch * config.block_size / per_step).backward()
            loss_sum += loss.item() * long_batch * config.block_size
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        tokens += per_step
        since, n_since = since + loss_sum / per_step, n_since + 1
        last = step == recipe.steps - 1
        if (step + 1) % recipe.eval_every == 0 or last:
            model.eval()
            held = bits_per_byte(model, heldout)
            model.train()
            point = CurvePoint(step + 1, tokens, round(time.perf_counter() - t0, 1), lr,
                               since / n_since / math.log(2), held)
            curve.append(point)
            on_point(point)
            since, n_since = 0.0, 0
    return model.eval(), tuple(curve)


# ---------------------------------------------------------------------------- saving


def hf_state(model: GPT, dtype: torch.dtype) -> dict[str, Tensor]:
    """The model's weights under Hugging Face GPT-2 names, Conv1D weights (in, out)."""
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to wte: saved once, as HF's GPT-2 does
            continue
        t = t.t() if name.endswith(_CONV1D) else t
        state[name] = t.detach().to(dtype).contiguous()
    return state


def save_checkpoint(
    model: GPT,
    out: Path,
    recipe: Recipe,
    corpus: Corpus,
    curve: tuple[CurvePoint, ...],
    seconds: float,
    dtype: torch.dtype = torch.float32,
    init: dict | None = None,
) -> dict:
    """Write config.json, model.safetensors, recipe.json, curve.json and heldout.txt.

    Returns the recipe record (what recipe.json holds).
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = model.config
    config = dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"],
        n_positions=c.block_size, n_ctx=c.block_size, vocab_size=c.vocab_size,
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None,
        tokenizer="bytes",  # kvcache's key: token ids are UTF-8 bytes, no BPE
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(hf_state(model, dtype), str(out / "model.safetensors"))
    (out / "heldout.txt").write_bytes(corpus.heldout)
    (out / "curve.json").write_text(json.dumps([asdict(p) for p in curve], indent=1) + "\n")
    # The loss of the weights as saved (rounded to `dtype`), the figure tests check against.
    from kvcache_cli.models.gpt2 import load_gpt2

    saved = load_gpt2(str(out), weights="pretrained").model
    heldout = torch.frombuffer(bytearray(corpus.heldout), dtype=torch.uint8)
    record = dict(
        recipe=asdict(recipe),
        python=sys.version.split()[0],
        torch=torch.__version__,
        parameters=model.num_params(),
        train_bytes=int(corpus.train.numel()),
        heldout_bytes=len(corpus.heldout),
        seconds=round(seconds, 1),
        final_train_bits=curve[-1].train_bits if curve else None,
        heldout_bits=bits_per_byte(saved, heldout),
        heldout_bits_first_512=bits_per_byte_prefix(saved, heldout, 512),
        files=list(corpus.files),
    )
    if init is not None:  # the record of the checkpoint this one trained on from
        record["init"] = {k: v for k, v in init.items() if k != "files"}
    (out / "recipe.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def bits_per_byte_prefix(model: GPT, ids: Tensor, n: int) -> float:
    """Bits per byte over the first n predictions of ids (one window from position 0)."""
    return bits_per_byte(model, ids[:n + 1])
