"""A Llama-family model's own tokenizer: byte-level BPE from a GGUF, or a tokenizer.json.

The `tokenizers` library (which transformers installs) runs it; this module builds it from
a GGUF's vocabulary and merges, and wraps it in the part of tiktoken's Encoding that
kvcache uses (`encode`, `decode`, the bytes of one token for streaming). Torch-free.

A GGUF names its pre-tokenizer (how text is split before the merges) by llama.cpp's name:
`smollm` splits every digit on its own and then splits as GPT-2 does (transformers'
SmolLM2 tokenizer.json: Digits(individual) then ByteLevel); `gpt2` and `default` split
as GPT-2 does.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

PRE_TOKENIZERS = ("default", "gpt2", "gpt-2", "smollm")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that are never split


@functools.cache
def _byte_of() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted: how a token string is bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def merge_pairs(vocab: dict[str, int], merges: list, what: str = "merge") -> list[tuple]:
    """Each merge 'a b' as (a, b): two tokens of the vocabulary, one space between, whose
    join is a token too; else a ValueError naming it (the tokenizers library would panic)."""
    from kvcache_cli.models.bounds import shown

    pairs = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2 or not all(part in vocab for part in (*parts, "".join(parts))):
            raise ValueError(f"{what}[{i:,}] is {shown(merge)}; expected two tokens of the "
                             "vocabulary, one space between, whose join is a token too")
        pairs.append((parts[0], parts[1]))
    return pairs


def from_gguf(tokens: list[str], token_types: list[int], merges: list[str], pre: str):
    """A `tokenizers.Tokenizer` for a GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer {pre!r}: kvcache splits text as "
                         f"{', '.join(PRE_TOKENIZERS)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"the vocabulary repeats {len(tokens) - len(vocab):,} tokens; "
                         "expected each token once")
    pairs = merge_pairs(vocab, merges)
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre == "smollm":
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types)
                            if kind in (_CONTROL, _USER_DEFINED)])
    return tok


class BPEEncoding:
    """A tokenizer.json's tokenizer with the part of tiktoken's Encoding kvcache uses."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the Rust parser's errors are plain strings
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
            raise ValueError(f"{path}: not a readable tokenizer.json ({first})") from None
        self.name = str(path)
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self._special = {i for i, t in self._tok.get_added_tokens_decoder().items()
                         if t.special}
        # What the tokenizer puts before every text (Gemma's <bos>; none in a byte-level
        # BPE converted from a GGUF), and whether its pieces are SentencePiece's: ▁ for a
        # space, <0xNN> for a byte no piece spells.
        self._prefix = self._tok.encode("", add_special_tokens=True).ids
        self._sentencepiece = bool(getattr(self._tok.model, "byte_fallback", False))

    def encode(self, text: str, disallowed_special=()) -> list[int]:
        # Special tokens typed in the text are the tokens (a chat template writes them):
        # the tokenizer's prefix only where the text does not begin with it already.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        prefix = self._prefix
        return ids if ids[:len(prefix)] == prefix else prefix + ids

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_single_token_bytes(self, token: int) -> bytes:
        piece = self._tok.id_to_token(token)
        if piece is None:
            raise ValueError(f"token id {token} is not in the vocabulary (0..{self.n_vocab - 1})")
        if token in self._special:
            return piece.encode("utf-8")
        if self._sentencepiece:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        byte_of = _byte_of()
        if all(c in byte_of for c in piece):
            return bytes(byte_of[c] for c in piece)
        return piece.encode("utf-8")  # a token outside the byte alphabet: its text

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.decode_single_token_bytes(int(t)) for t in ids)


@functools.cache
def bpe_encoding(path: str) -> BPEEncoding:
    return BPEEncoding(path)


class ByteEncoding:
    """UTF-8 bytes as token ids 0..255, with the part of tiktoken's Encoding we use.

    The tokenizer of byte-level checkpoints (`tokenizer: bytes` in config.json, as the
    shipped stdlib-bytes has): nothing to download, every text encodes, and decoding
    replaces a byte sequence that is not UTF-8 (a character cut in two) with U+FFFD.
    """

    name = "bytes"
    n_vocab = 256

    def encode(self, text: str, disallowed_special=()) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids) -> bytes:
        bad = next((t for t in ids if not 0 <= t < 256), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not a byte (0..255)")
        return bytes(ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_single_token_bytes(self, token: int) -> bytes:
        return self.decode_bytes([token])


def encoding_for(tokenizer: str):
    """(the encoding a model's config names, None), or (None, one line saying why not)."""
    if tokenizer == "bytes":
        return ByteEncoding(), None
    if tokenizer.startswith("file:"):  # a Llama-family model's own (models.tokenizer)
        from kvcache_cli.models.tokenizer import bpe_encoding

        try:
            return bpe_encoding(tokenizer.removeprefix("file:")), None
        except ValueError as err:
            return None, str(err)
    return gpt2_encoding()


@functools.cache  # one try per process: a failed download would fail again
def gpt2_encoding(timeout_s: float = 10.0):
    """(tiktoken's gpt2 Encoding, None), or (None, one line saying why not).

    tiktoken downloads its two files on first use and caches them; its download has
    no timeout, so it runs in a thread we stop waiting for.
    """
    box: dict[str, object] = {}

    def load() -> None:
        try:
            import tiktoken
        except ImportError:
            box["why"] = "tiktoken is not installed"
            return
        try:
            box["enc"] = tiktoken.get_encoding("gpt2")
        except Exception as error:  # no network, a bad cache: either way, no encoding
            failure = type(error).__name__
            box["why"] = f"its files are not cached and could not be fetched: {failure}"

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "enc" in box:
        return box["enc"], None
    why = box.get("why", f"no answer within {timeout_s:g} s")
    return None, f"tiktoken's gpt2 encoding is unavailable ({why})"
