"""A server's rows (`serve --target`) beside kvcache's engines: its tokens/s over theirs,
and its replies held against each request's solo tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache_cli.serving.results import EngineResult, ServeResult
from kvcache_cli.serving.sequence import Request


def beside(result: ServeResult, rows: Sequence[EngineResult]) -> ServeResult:
    """kvcache's engines and the server's rows in one result, rate by rate (the server's
    after the engines), with the server's tokens/s over sequential's and hf's."""
    import dataclasses

    def ratio(e: EngineResult, base: str) -> float | None:
        other = next((b for b in result.engines if b.engine == base and b.rate == e.rate), None)
        return None if other is None else e.tokens_per_s / other.tokens_per_s

    rows = [dataclasses.replace(e, over_sequential=ratio(e, "sequential"),
                                over_hf=ratio(e, "hf")) for e in rows]
    engines = tuple(e for rate in result.rates
                    for e in (*result.at(rate), *(x for x in rows if x.rate == rate)))
    return dataclasses.replace(result, engines=engines)


def agreed_tokens(text: str, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> int:
    """How many of `tokens` the server's `text` begins with, read as text: a server streams
    text, and re-encoding it need not give back the ids it generated, so the solo tokens
    are decoded instead, one more at a time."""
    n = 0
    while n < len(tokens) and text.startswith(decode(list(tokens[:n + 1]))):
        n += 1
    return n


def check_replies(row: EngineResult, requests: Sequence[Request],
                  solo: Sequence[Sequence[int]], decode: Callable[[list[int]], str],
                  model) -> EngineResult:
    """The server's replies held against each request's solo tokens (exact, or where they
    split, with the solo logits' top-2 gap there: a near-tie, or not)."""
    import dataclasses

    from kvcache_cli.serving.engines import mismatches

    if row.remote is None or len(row.remote.texts) != len(requests):
        return row
    reference, got = {}, {}
    for r, text, tokens in zip(requests, row.remote.texts, solo, strict=True):
        tokens = list(tokens)
        # The stop token ends the solo reply; a server ends there without streaming it.
        said = tokens[:-1] if tokens and tokens[-1] in r.stop_ids else tokens
        reference[r.id] = said
        n = agreed_tokens(text, said, decode)
        same = n == len(said) and text == decode(said)
        got[r.id] = said if same else said[:n] + [-1]  # -1: no token id, where they split
    found = mismatches(model, requests, got, reference)
    return dataclasses.replace(row, requests_exact=len(requests) - len(found),
                               mismatches=found)

