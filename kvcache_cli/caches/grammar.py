"""The grammar every cache spec is read with: the error a bad spec raises, what a kind
declares (`CacheKind`), and the field readers every kind's parser shares (whole numbers,
lettered fields, a field given once, the block size). Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache_cli import numbers


class CacheSpecError(ValueError):
    """A cache spec that names no known kind or has a malformed field (one line)."""


# (params, tokens, kv_heads, head_dim, element_bytes) -> bytes one layer holds for one
# sequence of `tokens` tokens, keys and values together, at the model's element size.
LayerBytes = Callable[[dict, int, int, int, int], int]

# The fields after the kind's name -> its parameters (raise CacheSpecError when bad).
Parse = Callable[[str, tuple[str, ...]], dict]


@dataclass(frozen=True)
class CacheKind:
    name: str
    summary: str  # one line: --help, completion, `kvcache caches`
    grammar: str  # how to spell it, e.g. 'window:W'
    factory: str  # 'module:Class' that builds it; imported only when a cache is made
    parse: Parse
    layer_bytes: LayerBytes
    exact: bool  # logits equal the full-precision cache's, up to float noise
    bounded: bool  # memory stops growing once full
    pages: bool  # can be held in serve's block pool
    compiles: bool  # its decode step has one shape (torch.compile, CUDA graphs)
    rollback: str  # how crop(n) forgets the newest tokens; '' when it cannot
    aliases: tuple[str, ...] = field(default=())
    # params -> the spelling that parses back to them; None: the kind's name alone.
    spell: Callable[[dict], str] | None = None
    # What rolling back k tokens reads or writes (`kvcache caches`); '' when not stated.
    rollback_bytes: str = ""
    # params -> the most positions it holds (a bounded kind); None: every position.
    budget: Callable[[dict], int] | None = None
    # It compresses the prompt once, at the prefill (its first forward), then appends:
    # its layer_bytes count a prompt of `tokens` tokens compressed, and check_prompt
    # refuses a budget or a window the prompt cannot fill.
    compresses: bool = False

    def canonical(self, params: dict) -> str:
        return self.spell(params) if self.spell else self.name


def whole_number(spec: str, what: str, text: str, low: int = 1, high: int = 1 << 20) -> int:
    """A field's integer, or a CacheSpecError naming the spec, the field and the range
    (`numbers.whole`: ASCII digits only, the length bounded before converting)."""
    try:
        return numbers.whole(text, what, low, high)
    except numbers.NumberError as err:
        raise CacheSpecError(f"cache spec {spec!r}: {err}") from None


def lettered(field: str, letters) -> str:
    """The letter of a field such as g32, r128 or b16 (among LETTERS; the number may be
    missing or wrong, its refusal names it), or '' where FIELD is not one: 'rot2' is an
    unknown word, not a residual of 'ot2', and is refused whole."""
    word = field[1:2].isascii() and field[1:2].isalpha()
    return field[0] if field[:1] and field[0] in letters and not word else ""


def no_fields(spec: str, fields: tuple[str, ...]) -> dict:
    if fields:
        name = spec.split(":", 1)[0]
        raise CacheSpecError(f"cache spec {spec!r}: {name} takes no fields; expected {name!r}")
    return {}


def every_token(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """K and V of every token at the model's element size: the exact cache's bytes."""
    return 2 * tokens * kv_heads * head_dim * element


def give_once(spec: str, given: dict, what: str, value) -> None:
    """Record a field's value, refusing a field given twice in one spec."""
    if what in given:
        raise CacheSpecError(f"cache spec {spec!r}: {what} given twice")
    given[what] = value


# vLLM's default block size on GPUs, and serve's.
DEFAULT_BLOCK_SIZE = 16


def parse_paged(spec: str, fields: tuple[str, ...]) -> dict:
    given: dict = {}
    for f in fields:
        if not lettered(f, "b"):
            raise CacheSpecError(f"cache spec {spec!r}: unknown field {f!r}; expected bN, "
                                 "the block size in tokens (e.g. paged:b16)")
        give_once(spec, given, "block size", whole_number(spec, "block size", f[1:], 1, 4096))
    return {"block_size": given.get("block size", DEFAULT_BLOCK_SIZE)}
