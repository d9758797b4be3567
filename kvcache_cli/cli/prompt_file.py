"""`bench --prompt-file`: the text a run's prompt is cut from, and its token ids."""

from __future__ import annotations

from pathlib import Path

from kvcache_cli.cli.refusals import fail


def read_prompt(path: Path | None) -> str | None:
    """--prompt-file's text, or None without one; a bad file is one line, exit 2."""
    if path is None:
        return None
    if not path.exists():
        fail(f"--prompt-file {str(path)!r}: no such file; expected a text file")
    if not path.is_file():  # a directory, a device: there, but not a file to read
        fail(f"--prompt-file {str(path)!r} is not a regular file; expected a text file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        fail(f"--prompt-file {str(path)!r}: not readable as UTF-8 text ({type(err).__name__})")


def prompt_ids(model, text: str) -> list[int]:
    """The text's token ids for the model: bytes for a byte-level model, else GPT-2's BPE."""
    from kvcache_cli.models.gpt2 import GPT2_VOCAB_SIZE
    from kvcache_cli.models.tokenizer import gpt2_encoding

    if model.config.tokenizer == "bytes":
        return list(text.encode("utf-8"))
    if model.config.vocab_size != GPT2_VOCAB_SIZE:
        fail(f"--prompt-file: the model's vocabulary ({model.config.vocab_size}) is not GPT-2's "
             "and it reads no bytes: no tokenizer for its text")
    encoding, why = gpt2_encoding()
    if encoding is None:
        fail(f"--prompt-file: {why}")
    return encoding.encode(text, disallowed_special=())
