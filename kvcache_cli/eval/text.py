"""The text `kvcache eval` reads, and how it becomes token ids, checked before a model loads.

A text is a UTF-8 file: an empty file, a binary one (a NUL byte, or bytes that are not
UTF-8) or something that is not a regular file is refused in one line. Which tokenizer
turns it into ids is the one the model's config names: `bytes` for the trained byte-level
checkpoint (the UTF-8 bytes are the ids, nothing to download), else GPT-2's BPE through
tiktoken (whose files must be cached or downloadable) for GPT-2's vocabulary.
Torch-free at import: the checks run before torch is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BYTE_VOCAB = 256
GPT2_VOCAB = 50257  # tiktoken's gpt2 encoding
# A text far longer than any context window: reading more would only cost memory.
MAX_TEXT_BYTES = 64 * 2**20


class TokenizerUnavailable(RuntimeError):
    """The model's tokenizer cannot be had here (tiktoken offline without its files)."""


@dataclass(frozen=True)
class EvalText:
    name: str  # what the ids are, for the result's header
    ids: tuple[int, ...]
    tokenizer: str  # "bytes", "gpt2", or "file:PATH" (a Llama-family model's own)


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents, or a ValueError naming the file and what is wrong."""
    what = f"--text {str(path)!r}"
    if not path.exists():
        raise ValueError(f"{what}: no such file; expected a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"{what} is not a regular file; expected a UTF-8 text file")
    with path.open("rb") as f:
        data = f.read(MAX_TEXT_BYTES)
    if not data.strip():
        raise ValueError(f"{what} is empty; expected a UTF-8 text file with something in it")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{what} looks binary (a NUL byte at offset {nul:,}); expected a "
                         "UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        # A read cut at MAX_TEXT_BYTES may split the last character: that tail alone goes.
        if len(data) == MAX_TEXT_BYTES and error.start >= len(data) - 3:
            return data[:error.start].decode("utf-8")
        raise ValueError(f"{what} is not UTF-8 text (byte {error.start:,} is not valid "
                         "UTF-8); expected a UTF-8 text file") from None


def tokenizer_for(config) -> str:
    """The tokenizer a model's config names (`tokenizer: bytes` in config.json, as the
    trained checkpoint has), else GPT-2's BPE for GPT-2's vocabulary; a ValueError when a
    checkpoint names none and has another vocabulary (generate reads it the same way)."""
    if config.tokenizer == "bytes" or config.tokenizer.startswith("file:"):
        return config.tokenizer
    if config.vocab_size == GPT2_VOCAB:
        return "gpt2"
    raise ValueError(f"no tokenizer for a vocabulary of {config.vocab_size:,} ids: expected "
                     f"'tokenizer': 'bytes' in its config.json ({BYTE_VOCAB} ids) or GPT-2's "
                     f"{GPT2_VOCAB:,}")


def encode(text: str, tokenizer: str) -> tuple[int, ...]:
    """Token ids of `text`; TokenizerUnavailable when GPT-2's BPE cannot be loaded."""
    if tokenizer == "bytes":
        return tuple(text.encode("utf-8"))
    from kvcache_cli.models.tokenizer import encoding_for

    encoding, why = encoding_for(tokenizer)
    if encoding is None:
        raise TokenizerUnavailable(why)
    return tuple(encoding.encode(text, disallowed_special=()))


def eval_text(text: str, name: str, config) -> EvalText:
    """`text` as the ids of the model's tokenizer."""
    tokenizer = tokenizer_for(config)
    return EvalText(name, encode(text, tokenizer), tokenizer)
