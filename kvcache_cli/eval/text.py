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
# The first read of a text, in bytes per token wanted: more than any tokenizer's token
# takes in ordinary text (GPT-2's BPE about 4, bytes 1), so one read is nearly always enough.
FIRST_READ_BYTES_PER_TOKEN = 16


class TokenizerUnavailable(RuntimeError):
    """The model's tokenizer cannot be had here (tiktoken offline without its files)."""


@dataclass(frozen=True)
class EvalText:
    name: str  # what the ids are, for the result's header
    ids: tuple[int, ...]
    tokenizer: str  # "bytes", "gpt2", or "file:PATH" (a Llama-family model's own)


def read_text(path: Path, limit: int | None = None) -> str:
    """A UTF-8 text file's contents (its first LIMIT bytes, MAX_TEXT_BYTES unless given, a
    character cut there dropped), or a ValueError naming the file and what is wrong."""
    limit = MAX_TEXT_BYTES if limit is None else limit
    what = f"--text {str(path)!r}"
    if not path.exists():
        raise ValueError(f"{what}: no such file; expected a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"{what} is not a regular file; expected a UTF-8 text file")
    with path.open("rb") as f:
        data = f.read(limit)
    if not data.strip():
        raise ValueError(f"{what} is empty; expected a UTF-8 text file with something in it")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{what} looks binary (a NUL byte at offset {nul:,}); expected a "
                         "UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        # A read cut at LIMIT may split the last character: that tail alone goes.
        if len(data) == limit and error.start >= len(data) - 3:
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


def read_tokens(path: Path, config, wanted: int) -> EvalText:
    """The ids of the file's first WANTED tokens, or of all of it when it has fewer: a
    prefix read and tokenized, four times longer while it falls short, so a huge file costs
    what is asked (an 80 MB one read whole asked its tokenizer for 5 GB and died). Read in
    part, the ids end WANTED tokens in: the last ones of a cut text may be split words."""
    tokenizer = tokenizer_for(config)
    limit = min(MAX_TEXT_BYTES, max(wanted, 1) * FIRST_READ_BYTES_PER_TOKEN)
    size = path.stat().st_size if path.is_file() else 0
    while True:
        ids = encode(read_text(path, limit), tokenizer)
        whole = size <= limit
        if whole or len(ids) > wanted or limit >= MAX_TEXT_BYTES:
            return EvalText(str(path), ids if whole else ids[:wanted], tokenizer)
        limit = min(MAX_TEXT_BYTES, 4 * limit)
