"""Hostile model files, generated from the format: a valid tiny GGUF, written by the project's
own writer, changed one thing at a time. For every metadata key the reader uses, the values
of its type no model takes (zero, negative, huge, NaN, infinite, another type, an empty or
oversized array, invalid UTF-8) and those that break its agreement with the tensors or the
other keys; for every tensor, an offset past the data, into another tensor's bytes or off
the alignment, a shape whose product overflows, a type kvcache does not read, non-finite
weights; the file cut at every boundary of its layout; the tokenizer's pieces and merges;
chat templates that raise, reach past the sandbox or run without end; paths that are not
files; converted folders that are corrupt, half-written or stale. For a Gemma 3 file: a
non-finite float16 at every even byte of a block of every block type read, every tensor
relabelled to every other type or a row short or long, rows not whole blocks, every
`gemma3.*` key hostile (window, layer pattern, rotary bases), QK-norms of the wrong width.

Each case must end in one ValueError of one line, naming the file, within a bounded time
(a hang is stopped and fails), or, for a converted folder, in a conversion done again; a
sample of each class goes through the real commands (exit 2, one `error:` line on stderr,
no traceback). The cases of a class run in one test, each on its own file: a list of the
cases that failed says what went wrong.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import gemmakit
import numpy as np
import pytest
import torch
from ggufkit import (
    ARRAY,
    BOOL,
    F32,
    F64,
    GGUF,
    I32,
    I64,
    STRING,
    U32,
    U64,
    Value,
    parse,
    tensor_bytes,
    write,
)
from llamakit import CHAT_TEMPLATE
from typer.testing import CliRunner

from kvcache_cli.models import bounds
from kvcache_cli.models.gguf import layout
from kvcache_cli.models.gguf.reader import TENSOR_TYPES, read_gemma3, read_gguf
from kvcache_cli.models.llama import LlamaConfig

LIMIT_S = 20  # each refusal takes milliseconds; a case still running here has hung
TINY = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=96,
                   vocab_size=300, context=128, tie_word_embeddings=True,
                   chat_template=CHAT_TEMPLATE, name="tiny llama")
runner = CliRunner()


def tiny_state(c: LlamaConfig) -> dict[str, torch.Tensor]:
    """A Llama's weights in transformers' names, drawn from a seeded generator."""
    g = torch.Generator().manual_seed(0)
    C, hs, inner = c.n_embd, c.head_size, c.intermediate

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    state = {"model.embed_tokens.weight": w(c.vocab_size, C)}
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(c.n_head * hs, C),
            p + "self_attn.k_proj.weight": w(c.n_kv_head * hs, C),
            p + "self_attn.v_proj.weight": w(c.n_kv_head * hs, C),
            p + "self_attn.o_proj.weight": w(C, c.n_head * hs),
            p + "mlp.gate_proj.weight": w(inner, C), p + "mlp.up_proj.weight": w(inner, C),
            p + "mlp.down_proj.weight": w(C, inner),
            p + "input_layernorm.weight": torch.ones(C),
            p + "post_attention_layernorm.weight": torch.ones(C),
        })
    state["model.norm.weight"] = torch.ones(C)
    return state


@pytest.fixture(scope="module")
def base_file(tmp_path_factory) -> Path:
    from kvcache_cli.models.gguf.export import write_llama

    path = tmp_path_factory.mktemp("base") / "tiny.gguf"
    return write_llama(tiny_state(TINY), TINY, path)


@pytest.fixture(scope="module")
def base(base_file) -> GGUF:
    g = parse(base_file.read_bytes())
    assert write(g) == base_file.read_bytes()  # the kit writes back what it read
    return g


@pytest.fixture
def small_memory(monkeypatch):
    """A machine of 256 MiB: a static cache of the tiny model's 2^20 positions (512 MiB)
    does not fit, while the model itself does."""
    monkeypatch.setattr(bounds, "physical_memory", lambda: 256 * 2**20)


# --- the one contract --------------------------------------------------------------------


class Hang(BaseException):
    """A case ran past LIMIT_S (a BaseException: no `except Exception` of the code stops it)."""


@contextmanager
def within(seconds: float):
    def stop(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def what_went_wrong(call, names: tuple[str, ...]) -> str | None:
    """None when call() ends in one ValueError of one line naming each of `names` within
    LIMIT_S; else what happened instead."""
    try:
        with within(LIMIT_S):
            call()
    except ValueError as err:
        message = str(err)
        if "\n" in message:
            return f"a message of {message.count(chr(10)) + 1} lines: {message[:200]!r}"
        missing = [n for n in names if n not in message]
        return f"the message does not name {missing}: {message[:200]}" if missing else None
    except Hang as err:
        return str(err)
    except BaseException as err:  # noqa: BLE001 - any other end is the failure reported
        return f"{type(err).__name__}: {str(err)[:200]}"
    return "accepted"


def refused_all(tmp_path: Path, cases, load=read_gguf) -> list[str]:
    """Each case (id, bytes, names) written to its own file and read; the failures."""
    failures = []
    for i, (case, data, names) in enumerate(cases):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(data)
        wrong = what_went_wrong(partial(load, path), (str(path), *names))
        if wrong:
            failures.append(f"{case}: {wrong}")
        path.unlink()
    return failures


def test_the_base_file_reads_and_every_case_starts_from_it(base_file):
    model = read_gguf(base_file)
    assert (model.fields["n_layer"], model.fields["n_kv_head"], model.fields["vocab_size"]) == (
        2, 2, 300)


# --- metadata: every key the reader uses, every hostile value of its type ------------------

NAN, INF = math.nan, math.inf
# Values no whole-number key takes: negative, past every bound, not whole, not a number.
NOT_WHOLE = [("-1", Value(I32, -1)), ("2^32-1", Value(U32, 2**32 - 1)),
             ("2^64-1", Value(U64, 2**64 - 1)), ("-2^63", Value(I64, -(2**63))),
             ("nan", Value(F32, NAN)), ("inf", Value(F32, INF)), ("1.5", Value(F32, 1.5)),
             ("text", Value(STRING, b"8")), ("bool", Value(BOOL, True)),
             ("array", Value(ARRAY, [8], U32)), ("empty array", Value(ARRAY, [], U32))]
# Values no positive float takes.
NOT_POSITIVE = [("nan", Value(F32, NAN)), ("inf", Value(F32, INF)), ("-inf", Value(F32, -INF)),
                ("0", Value(F32, 0.0)), ("-0", Value(F32, -0.0)), ("-1", Value(F32, -1.0)),
                ("1e300", Value(F64, 1e300)), ("-5", Value(I32, -5)),
                ("text", Value(STRING, b"1e4")), ("bool", Value(BOOL, True)),
                ("array", Value(ARRAY, [1.0], F32))]
# Values no text key takes: another type, not UTF-8, past the format's limit on a string.
NOT_TEXT = [("number", Value(U32, 7)), ("array", Value(ARRAY, [b"llama"], STRING)),
            ("not UTF-8", Value(STRING, b"\xff\xfe")),
            ("oversized", Value(STRING, b"a" * (layout.MAX_STRING_BYTES + 1)))]


def _whole_cases(g: GGUF, key: str, field: str | None):
    """Hostile values of a whole-number key: the type's, its bound's, and (for a key of the
    shape) the base value moved by one or doubled, which the tensors or the other keys
    no longer agree with."""
    cases = [(case, value, True) for case, value in NOT_WHOLE]
    if field is not None:
        b = bounds.BOUNDS[field]
        cases += [("0", Value(U32, 0), True), (f"{b.high:,} + 1", Value(U64, b.high + 1), True)]
        v = g.metadata[key].value if key in g.metadata else None
        if v is not None and field != "context":  # any context under the bound is valid
            # Refused by whichever check sees the disagreement first: maybe a tensor's.
            cases += [(str(n), Value(U32, n), False) for n in (v - 1, v + 1, 2 * v) if n > 0]
    else:  # a token id: zero is one, the vocabulary's size is not
        cases += [("vocab", Value(U32, TINY.vocab_size), True),
                  ("2 vocab", Value(U32, 2 * TINY.vocab_size), True)]
    return cases


def metadata_cases(g: GGUF):
    """(id, file bytes, what the refusal must name) for every hostile value of every key."""
    arch = "llama"
    fields = {f"{arch}.{b.key}": f for f, b in bounds.BOUNDS.items()}
    whole = [*fields, f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"]
    ids = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
           "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id"]
    floats = [k for k, f in fields.items() if not bounds.BOUNDS[f].whole]
    for key in whole + ids:
        if key in floats:
            continue
        for case, value, named in _whole_cases(g, key, fields.get(key)):
            yield f"{key}={case}", write(g.with_value(key, value)), (key,) if named else ()
    for key in floats:
        edges = [("1", Value(F32, 1.0)), ("1e13", Value(F64, 1e13))] if "freq" in key else [
            ("1.5", Value(F32, 1.5))]
        for case, value in NOT_POSITIVE + edges:
            yield f"{key}={case}", write(g.with_value(key, value)), (key,)
    content = {"general.architecture": [b"", b"gpt2", b"llama\x00"],
               "tokenizer.ggml.model": [b"", b"llama", b"gpt2 "],
               "tokenizer.ggml.pre": [b"", b"qwen2"],
               "general.name": [b"a\nb", b"\x1b[2J", b"x" * 300],
               "tokenizer.chat_template": []}
    for key, texts in content.items():
        for case, value in NOT_TEXT + [(repr(t[:20]), Value(STRING, t)) for t in texts]:
            yield f"{key}={case}", write(g.with_value(key, value)), ()
    for case, value in [("0", Value(U32, 0)), ("3", Value(U32, 3)), ("2^17", Value(U32, 2**17)),
                        ("-1", Value(I32, -1)), ("text", Value(STRING, b"32"))]:
        yield f"general.alignment={case}", write(g.with_value("general.alignment", value)), (
            "general.alignment",)
    for case, value in [("linear", Value(STRING, b"linear")), ("yarn", Value(STRING, b"yarn")),
                        ("number", Value(U32, 1))]:
        key = f"{arch}.rope.scaling.type"
        yield f"{key}={case}", write(g.with_value(key, value)), (key,)
    # Keys without which there is no model (llama.cpp requires them too); a missing KV head
    # count means as many as the heads, which the tensors do not have.
    for key in ["general.architecture", *[k for k, f in fields.items() if f in (
            "n_layer", "n_head", "n_embd", "intermediate", "context")],
            f"{arch}.attention.head_count_kv", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges"]:
        yield f"{key} missing", write(g.with_value(key, None)), ()
    # A key given twice: the first entry repeated in place.
    data = write(g)
    entry_end = 24 + 8 + len("general.architecture") + 4 + 8 + len("llama")
    twice = data[:4] + struct.pack("<IQQ", 3, len(g.tensors), len(g.metadata) + 1) + \
        data[24:entry_end] + data[24:entry_end] + data[entry_end:]
    yield "general.architecture twice", twice, ("general.architecture",)


def test_every_hostile_metadata_value_is_refused_naming_its_key(base, tmp_path):
    cases = list(metadata_cases(base))
    assert len(cases) > 250
    assert refused_all(tmp_path, cases) == []


def test_a_context_whose_static_cache_passes_memory_is_refused_before_allocation(
        base, tmp_path, small_memory):
    path = tmp_path / "long.gguf"
    path.write_bytes(write(base.with_value("llama.context_length", Value(U32, 2**20))))
    # Reading the shape allocates nothing: `size` prices the context (issue 43); the loader,
    # which makes the rotary tables, refuses before it allocates.
    assert read_gguf(path).fields["context"] == 2**20
    from kvcache_cli.models.llama_loading import load_llama

    with pytest.raises(ValueError, match="context 1,048,576: a static cache") as e:
        load_llama(str(path), "random", "cpu", torch.float32)
    assert "512.0 GiB" not in str(e.value) and "0.2 GiB of memory" in str(e.value)


def test_a_missing_key_with_a_default_reads_as_the_default(base, tmp_path):
    path = tmp_path / "plain.gguf"
    for key in ("llama.rope.freq_base", "llama.attention.key_length", "general.name",
                "tokenizer.ggml.token_type", "tokenizer.ggml.pre"):
        path.write_bytes(write(base.with_value(key, None)))
        assert read_gguf(path).fields["n_layer"] == 2, key


# --- the tokenizer: pieces, merges, types ------------------------------------------------


def _tokens(g: GGUF) -> list[bytes]:
    return list(g.metadata["tokenizer.ggml.tokens"].value)


def tokenizer_cases(g: GGUF):
    """Tokens empty, repeated or not UTF-8 at the start, middle and end; merges that name
    unknown pieces, are not two pieces, or are not strings; token types out of range."""
    def with_tokens(tokens, item=STRING):
        return write(g.with_value("tokenizer.ggml.tokens", Value(ARRAY, tokens, item)))

    n = len(_tokens(g))
    for at in (0, n // 2, n - 1):
        for case, piece in [("empty", b""), ("not UTF-8", b"\xc3\x28"), ("a repeat", None)]:
            tokens = _tokens(g)
            tokens[at] = tokens[at - 1 if at else 1] if piece is None else piece
            yield f"token[{at}] {case}", with_tokens(tokens), ()
    yield "tokens as numbers", with_tokens(list(range(n)), U32), ()
    yield "500,000 tokens", with_tokens([f"t{i}".encode() for i in range(500_000)]), ()
    yield "an array past the limit", with_tokens([b"a"] * (layout.MAX_ARRAY + 1)), ()
    merges = [b"\xc4\xa0 t", b"zz t", b"\xc4\xa0 zz", b"\xc4\xa0t", b"\xc4\xa0 t x",
              b"\xc4\xa0  t", b"", b"a b", b"\xff t"]
    for m in merges:
        value = Value(ARRAY, [b"\xc4\xa0 t", m], STRING)
        if m == merges[0]:
            value = Value(ARRAY, [m, m + b" "], STRING)
        yield f"merge {m!r}", write(g.with_value("tokenizer.ggml.merges", value)), ()
    yield "merges as numbers", write(g.with_value("tokenizer.ggml.merges",
                                                  Value(ARRAY, [1, 2], U32))), ()
    types = list(g.metadata["tokenizer.ggml.token_type"].value)
    for case, value in [("short", Value(ARRAY, types[:-1], I32)),
                        ("long", Value(ARRAY, types + [1], I32)),
                        ("7", Value(ARRAY, types[:-1] + [7], I32)),
                        ("-1", Value(ARRAY, [-1] + types[1:], I32)),
                        ("text", Value(ARRAY, [b"1"] * n, STRING)),
                        ("empty", Value(ARRAY, [], I32))]:
        yield f"token_type {case}", write(g.with_value("tokenizer.ggml.token_type", value)), ()


def test_every_hostile_vocabulary_is_refused(base, tmp_path):
    cases = list(tokenizer_cases(base))
    assert len(cases) > 25
    assert refused_all(tmp_path, cases) == []


# --- tensors: where their bytes lie, their shape, type and values --------------------------


def tensor_cases(g: GGUF):
    """For every tensor: its bytes past the data, off the alignment, inside another's; a
    shape overflowing, with a zero or too many dimensions, another's shape; a type
    unknown or not read; a NaN or an infinity among its weights; its name repeated,
    unknown, not UTF-8 or too long."""
    end = -(-len(g.data) // 32) * 32
    for i, t in enumerate(g.tensors):
        name = t.name.decode()
        other = g.tensors[i - 1 if i else 1]
        start, stop = tensor_bytes(g, i)
        variants = [
            ("past the data", dict(offset=end)), ("unaligned", dict(offset=t.offset + 4)),
            ("aliased", dict(offset=other.offset)),
            ("overlapping", dict(offset=other.offset + 32)),
            ("product overflowing", dict(dims=(2**32, 2**32) + t.dims[2:])),
            ("2^63 long", dict(dims=(2**63,) + t.dims[1:])),
            ("a zero dimension", dict(dims=(0,) + t.dims[1:])),
            ("5 dimensions", dict(dims=t.dims + (1,) * (5 - len(t.dims)))),
            ("another's shape", dict(dims=tuple(d + 32 for d in t.dims))),
            ("type 99", dict(kind=99)), ("type I32", dict(kind=26)),
            ("type IQ2_XXS", dict(kind=16)),
            ("a repeated name", dict(name=other.name)),
            ("an unknown name", dict(name=b"blk.0.attn_qkv.weight")),
            ("a name not UTF-8", dict(name=b"\xff" + t.name[1:])),
            ("a name too long", dict(name=b"x" * 65)),
        ]
        if name.startswith("blk.0."):  # the same block written as 00: one tensor twice
            variants.append(("an alias of its block", dict(name=name.replace("blk.0.", "blk.00.")
                                                           .encode())))
        for case, change in variants:
            yield f"{name} {case}", write(g.with_tensor(i, **change)), ()
        for case, bad in [("NaN", NAN), ("inf", INF), ("-inf", -INF)]:
            at = start + 4 * ((stop - start) // 8)  # a weight in the middle
            data = g.data[:at] + struct.pack("<f", bad) + g.data[at + 4:]
            yield f"{name} {case} weight", write(replace(g, data=data)), (name,)


def test_every_hostile_tensor_entry_or_value_is_refused(base, tmp_path):
    cases = list(tensor_cases(base))
    assert len(cases) == len(base.tensors) * 19 + 9
    assert refused_all(tmp_path, cases) == []


def file_cases(g: GGUF):
    """The file cut inside every entry and at every boundary of its layout, the counts of
    its header false, bytes after its end, another magic or version."""
    data = write(g)
    cuts, at = {0, 4, 12, 23}, 24
    for key, value in g.metadata.items():
        n = len(write(replace(g, metadata={key: value}, tensors=[], data=b""))) - 24
        cuts |= {at + 1, at + n // 2, at + n - 1}
        at += n
    data_start = len(data) - len(g.data)
    for i in range(len(g.tensors)):
        start, stop = tensor_bytes(g, i)
        cuts |= {data_start + start + 1, data_start + (start + stop) // 2, data_start + stop - 1}
    cuts |= set(range(at, data_start, max(1, (data_start - at) // 40)))
    last = data_start + max(tensor_bytes(g, i)[1] for i in range(len(g.tensors)))
    for cut in sorted(c for c in cuts if c < last):
        yield f"cut at byte {cut:,}", data[:cut], ()
    for case, change in [("a tensor more", dict(n_tensors=len(g.tensors) + 1)),
                         ("a tensor less", dict(n_tensors=len(g.tensors) - 1)),
                         ("a key more", dict(n_keys=len(g.metadata) + 1)),
                         ("a key less", dict(n_keys=len(g.metadata) - 1)),
                         ("2^40 tensors", dict(n_tensors=2**40)), ("2^40 keys", dict(n_keys=2**40)),
                         ("version 1", dict(version=1)), ("version 4", dict(version=4))]:
        yield case, write(replace(g, **change)), ()
    yield "a MiB after the end", data + bytes(2**20), ()
    yield "GGML magic", b"GGML" + data[4:], ()
    yield "all zeros", bytes(len(data)), ()


def test_every_cut_lie_or_stray_byte_in_the_file_is_refused(base, tmp_path):
    cases = list(file_cases(base))
    assert len(cases) > 150
    assert refused_all(tmp_path, cases) == []


# --- paths: what is not a file, or not a file kvcache can hold ----------------------------


def path_cases(tmp_path: Path, base_file: Path):
    """(id, path) of things named .gguf that are no GGUF file kvcache could read."""
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    (tmp_path / "dir.gguf").mkdir()
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    (tmp_path / "dangling.gguf").symlink_to(tmp_path / "nowhere")
    (tmp_path / "device.gguf").symlink_to("/dev/zero")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "header.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    sparse = tmp_path / "sparse.gguf"
    shutil.copyfile(base_file, sparse)
    os.truncate(sparse, 200 * 10**9)  # a valid header, 200 GB on paper, nothing on disk
    return [fifo, tmp_path / "dir.gguf", loop, tmp_path / "dangling.gguf",
            tmp_path / "device.gguf", tmp_path / "empty.gguf", tmp_path / "header.gguf",
            sparse]


def test_every_path_that_is_no_model_file_is_refused_by_the_loader(tmp_path, base_file):
    from kvcache_cli.models import model_config

    failures = []
    for path in path_cases(tmp_path, base_file):
        wrong = what_went_wrong(partial(model_config, str(path)), (str(path),))
        if wrong:
            failures.append(f"{path.name}: {wrong}")
    assert failures == []


# --- chat templates: what raises, reaches past the sandbox, recurses or never ends --------

RAISING = ["{{ raise_exception('no') }}", "{{ undefined_name.attribute }}", "{{ 1 / 0 }}",
           "{% for %}", "{{ messages[99].content.x }}", "{{ 'a' + 1 }}"]
FORBIDDEN = ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
             "{{ cycler.__init__.__globals__.os }}", "{{ messages.append(1) }}",
             "{{ messages.__class__.__base__ }}", "{{ self._TemplateReference__context.x }}",
             "{% include 'chat.jinja' %}", "{% include '/etc/passwd' %}",
             "{% import 'x' as y %}", "{% extends 'base' %}", "{% from 'x' import y %}",
             "{{ lipsum.__globals__['os'].popen('echo') }}"]
RECURSING = ["{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
             "{% macro f(n) %}{{ f(n + 1) ~ f(n + 2) }}{% endmacro %}{{ f(1) }}"]
HUGE = ["{{ 'x' * 10**8 }}", "{{ 'x' * 10**12 }}", "{{ range(10**9) | list }}",
        "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
        "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "{{ '{0:>999999999}'.format(1) }}", "{{ 'x' | center(10**10) }}"]
ENDLESS = ["{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
           "{{ 9 ** (9 ** 9) }}"]


def template_cases():
    """Every body at the top; the first of each kind that the sandbox stops also inside the
    messages loop and inside a macro, where its checks must reach too."""
    for kind, bodies in [("raising", RAISING), ("forbidden", FORBIDDEN),
                         ("recursing", RECURSING), ("huge", HUGE), ("endless", ENDLESS)]:
        for body in bodies:
            yield f"{kind} {body[:40]}", body
        if kind in ("raising", "forbidden", "recursing"):
            yield f"{kind} in a loop", "{% for m in messages %}" + bodies[0] + "{% endfor %}"
            yield f"{kind} in a macro", ("{% macro g() %}" + bodies[0] + "{% endmacro %}"
                                         "{{ g() }}")


def test_every_hostile_chat_template_is_one_line_in_bounded_time(monkeypatch):
    from kvcache_cli.models import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)  # a real one takes ms
    messages = [{"role": "user", "content": "hi"}]
    failures, cases = [], list(template_cases())
    assert len(cases) > 30
    for case, template in cases:
        started = time.monotonic()
        wrong = what_went_wrong(partial(chat_template.render_chat, template, messages),
                                ("chat template does not render",))
        if wrong:
            failures.append(f"{case}: {wrong}")
        elif time.monotonic() - started > 1.0 + 5:  # the limit, and a slow child's start
            failures.append(f"{case}: took {time.monotonic() - started:.1f} s")
    assert failures == []


def test_a_real_template_still_renders_through_the_limits():
    from kvcache_cli.models.chat_template import render_chats

    prompts = render_chats(CHAT_TEMPLATE, [[{"role": "user", "content": "hi"}],
                                           [{"role": "user", "content": "¿qué?"}]])
    assert prompts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                       "<|im_start|>user\n¿qué?<|im_end|>\n<|im_start|>assistant\n"]


# --- converted folders: corrupt, half-written, stale -------------------------------------


@pytest.fixture
def converted(base_file, tmp_path, monkeypatch):
    """(the GGUF, its converted folder, its true config) in a cache of the test's own."""
    from kvcache_cli.models import model_config
    from kvcache_cli.models.gguf.converted import converted_dir

    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    shutil.copyfile(base_file, gguf)
    return gguf, converted_dir(gguf), model_config(str(gguf))


def _restamp(folder: Path, gguf: Path) -> None:
    """The folder's stamp rewritten to match its files as they are now: a forged stamp."""
    from kvcache_cli.models.gguf.converted import write_stamp

    write_stamp(folder, gguf)


def folder_corruptions(folder: Path):
    """(id, change) for every file of a converted folder and every field of its config."""
    def removed(p):
        return lambda: p.unlink()

    def emptied(p):
        return lambda: p.write_bytes(b"")

    def halved(p):
        return lambda: os.truncate(p, p.stat().st_size // 2)

    def flipped(p):
        def flip():
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))
        return flip

    def a_folder(p):
        return lambda: (p.unlink(), p.mkdir())

    def a_link(p):
        return lambda: (p.unlink(), p.symlink_to(folder / "config.json"
                                                 if p.name != "config.json" else folder / "x"))

    for name in ("config.json", "tokenizer.json", "model.safetensors", "stamp.json"):
        p = folder / name
        for how in (removed, emptied, halved, flipped, a_folder, a_link):
            yield f"{name} {how.__name__}", how(p), False
    # Every field with values none of its kind takes, and a stamp forged to match: the
    # config's own checks must catch it (a stale stamp is the cases above).
    config = json.loads((folder / "config.json").read_text())
    for field in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate", "vocab_size",
                  "context", "rope_theta", "rms_eps", "eos_ids", "tie_word_embeddings",
                  "source_types", "name"):
        for case, value in [("missing", None), ("0", 0), ("-1", -1), ("nan", NAN),
                            ("text", "8"), ("list", [1]), ("huge", 2**62)]:
            if (field, case) in (("name", "text"), ("eos_ids", "list")):
                continue  # a name, an id list: values of the field's kind

            def edit(field=field, value=value, case=case):
                c = dict(config)
                if case == "missing":
                    del c[field]
                else:
                    c[field] = value
                (folder / "config.json").write_text(json.dumps(c))
            yield f"config {field}={case}", edit, True
    yield "no stamp (half-written)", removed(folder / "stamp.json"), False
    yield "the folder a file", lambda: (shutil.rmtree(folder), folder.write_text("x")), False
    yield "the folder a link", lambda: (shutil.rmtree(folder), folder.symlink_to("/tmp")), False


def test_every_corrupt_or_half_written_converted_folder_is_converted_again(converted):
    from kvcache_cli.models import model_config
    from kvcache_cli.models.gguf.converted import converted_config

    gguf, folder, truth = converted
    pristine = folder.with_name("pristine")
    shutil.copytree(folder, pristine)
    failures, count = [], 0
    for case, corrupt, restamp in folder_corruptions(folder):
        count += 1
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        corrupt()
        if restamp:
            try:
                _restamp(folder, gguf)
            except (OSError, ValueError):
                pass  # a file that cannot be stamped: the stamp stays stale
        try:
            with within(LIMIT_S):
                config = model_config(str(gguf))
        except BaseException as err:  # noqa: BLE001 - reported as the case's failure
            failures.append(f"{case}: {type(err).__name__}: {str(err)[:160]}")
            continue
        if config != truth:
            failures.append(f"{case}: read as {config}")
        elif converted_config(gguf) is None:
            failures.append(f"{case}: the folder is still not sound")
    assert count > 100
    assert failures == []


def test_a_stale_folder_of_a_file_changed_in_place_is_converted_again(converted):
    from kvcache_cli.models import model_config

    gguf, folder, truth = converted
    info = gguf.stat()
    data = gguf.read_bytes()
    at = data.index(b"tiny llama")
    gguf.write_bytes(data[:at] + b"tiny lamma" + data[at + 10:])  # same size
    os.utime(gguf, ns=(info.st_atime_ns, info.st_mtime_ns))  # the same time, too
    assert model_config(str(gguf)).name == "tiny lamma"


def test_weights_changed_in_a_converted_folder_are_not_loaded(converted):
    from kvcache_cli.models import load_model

    gguf, folder, truth = converted
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = struct.pack("<f", NAN)  # the last weight of the last tensor
    weights.write_bytes(bytes(data))
    model = load_model(str(gguf)).model  # the stamp no longer matches: converted again
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("where", ["root", "converted"])
def test_a_conversion_cache_that_is_a_file_is_refused_in_one_line(base_file, tmp_path,
                                                                    monkeypatch, where):
    from kvcache_cli.models import model_config

    root = tmp_path / "cache"
    blocker = root if where == "root" else root / "converted"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVCACHE_CACHE", str(root))
    with pytest.raises(ValueError, match=f"the conversion cache {blocker} is not a folder"):
        model_config(str(base_file))


def test_size_reads_a_converted_config_only_once_it_is_checked(converted):
    from kvcache_cli.models.live import live_config

    gguf, folder, truth = converted
    config = json.loads((folder / "config.json").read_text())
    del config["n_layer"]
    (folder / "config.json").write_text(json.dumps(config))
    _restamp(folder, gguf)
    assert live_config(str(gguf))["num_hidden_layers"] == 2  # the file's header, not trusted


# --- the commands: a sample of every class, each one line and exit 2 ---------------------

COMMANDS = {"generate": ["generate", "-m", "{}", "--ids", "1,2", "-n", "2"],
            "size": ["size", "-m", "{}"], "eval": ["eval", "-m", "{}"],
            "bench": ["bench", "-m", "{}"], "serve": ["serve", "-m", "{}"]}


def one_line_exit_2(args: list[str], **env: str) -> str:
    result = runner.invoke(app(), args, env={"COLUMNS": "100", **env})
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, repr(result.exception))
    assert result.exit_code == 2, (args, result.output)
    assert result.stdout == "", (args, result.stdout)  # nothing half-written
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    assert "Traceback" not in result.output
    return lines[0]


def app():
    from kvcache_cli.cli import app

    return app


def sample_files(g: GGUF, tmp_path: Path) -> dict[str, Path]:
    """One hostile file of each class."""
    tokens = _tokens(g)
    tokens[5] = tokens[4]
    data = g.data[:4] + struct.pack("<f", NAN) + g.data[8:]
    files = {
        "rope base NaN": g.with_value("llama.rope.freq_base", Value(F32, NAN)),
        "rope wider than a head": g.with_value("llama.rope.dimension_count", Value(U32, 32)),
        "a repeated token": g.with_value("tokenizer.ggml.tokens", Value(ARRAY, tokens, STRING)),
        "a merge of unknown pieces": g.with_value("tokenizer.ggml.merges",
                                                  Value(ARRAY, [b"zz yy"], STRING)),
        "an aliased tensor": g.with_tensor(2, offset=g.tensors[1].offset),
        "a NaN weight": replace(g, data=data),
        "2^20 positions": g.with_value("llama.context_length", Value(U32, 2**20)),
    }
    paths = {}
    for i, (case, hostile) in enumerate(files.items()):
        paths[case] = tmp_path / f"sample{i}.gguf"
        paths[case].write_bytes(write(hostile))
    return paths


def test_every_command_refuses_a_sample_of_every_class_in_one_line(base, tmp_path,
                                                                    small_memory):
    for case, path in sample_files(base, tmp_path).items():
        for command, args in COMMANDS.items():
            if (case, command) == ("2^20 positions", "size"):
                continue  # size allocates nothing: it prices the context (issue 43)
            if (case, command) == ("a NaN weight", "size"):
                continue  # size reads a file's header, never its weights
            line = one_line_exit_2([a.replace("{}", str(path)) for a in args])
            assert str(path) in line, (case, command, line)


def test_every_command_refuses_a_conversion_cache_that_is_a_file(base_file, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    for command, args in COMMANDS.items():
        line = one_line_exit_2([a.replace("{}", str(base_file)) for a in args],
                               KVCACHE_CACHE=str(blocker))
        assert f"the conversion cache {blocker} is not a folder" in line, (command, line)


def test_a_file_name_holding_a_newline_is_refused_in_one_line(tmp_path):
    path = tmp_path / "new\nline.gguf"
    path.write_bytes(b"GGUF")
    line = one_line_exit_2(["generate", "-m", str(path), "--ids", "1,2"])
    assert "new\\nline.gguf: 4 bytes, too short" in line


def test_a_hostile_chat_template_through_generate_and_serve_is_one_line(base, tmp_path):
    path = tmp_path / "template.gguf"
    path.write_bytes(write(base.with_value("tokenizer.chat_template", Value(
        STRING, b"{{ ''.__class__.__mro__[1].__subclasses__() }}"))))
    for args in (["generate", "-m", str(path), "--chat", "hi", "-n", "2"],
                 ["serve", "-m", str(path), "--requests", "2"]):
        assert "chat template does not render" in one_line_exit_2(args)


def test_the_command_line_refuses_a_hostile_file_in_a_process_of_its_own(base, tmp_path):
    path = tmp_path / "aliased.gguf"
    path.write_bytes(write(base.with_tensor(2, offset=base.tensors[1].offset)))
    run = subprocess.run([sys.executable, "-m", "kvcache_cli", "generate", "-m", str(path),
                          "--ids", "1,2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(f"error: {path}: tensor ")


# --- Gemma 3: k-quant and Q5 blocks, the hybrid layer pattern, QK-norm ------------------
# A tiny Gemma 3 of one layer (`gemmakit`: the real file's block types), changed one thing
# at a time; every case generated from the formats: each block type gguf defines and
# kvcache reads, each float16 a block could hold a scale in, each metadata key of the
# config, each tensor relabelled to each other type.

# The non-finite 2-byte values a block's scale (or an F16/BF16 weight) can hold.
HALF = [(case, struct.pack("<e", v)) for case, v in [("NaN", NAN), ("inf", INF), ("-inf", -INF)]]
BFLOAT = [(case, struct.pack("<f", v)[2:]) for case, v in [("NaN", NAN), ("inf", INF),
                                                            ("-inf", -INF)]]
GEMMA = dict(gemmakit.TINY, n_layer=1, vocab=32)
QUANTISED = [k for k in TENSOR_TYPES if k != "F32"]


@pytest.fixture(scope="module")
def gemma_base(tmp_path_factory) -> GGUF:
    path = gemmakit.write_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "tiny.gguf", t=GEMMA)
    return parse(path.read_bytes())


def _gemma_of_type(tmp_path: Path, kind: str) -> GGUF:
    """The tiny Gemma with blk.0.attn_output of type `kind`, every other tensor F32 (read
    at once: each case reads the whole file)."""
    path = tmp_path / f"{kind}.gguf"
    roles = {role: "F32" for role in gemmakit.TYPES} | {"attn_output": kind}
    return parse(gemmakit.write_tiny_gemma3(path, types=roles, t=GEMMA).read_bytes())


def _index(g: GGUF, name: str) -> int:
    return next(i for i, t in enumerate(g.tensors) if t.name == name.encode())


def block_scale_cases(tmp_path: Path):
    """For each block type: a NaN, +inf and -inf float16 (bfloat16 for BF16) written at
    every even byte of the first block of blk.0.attn_output (every type's scales lie at
    even bytes: what comes before them is a whole number of float16s). (id, bytes, names,
    refused): refused where gguf's own dequantiser makes a non-finite weight of the block
    so changed: at Q2_K's bytes 80 and 82, Q3_K's 108, Q6_K's 208, the others' 0 (and 2
    where a minimum follows the scale)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    name = "blk.0.attn_output.weight"
    for kind in QUANTISED:
        g = _gemma_of_type(tmp_path, kind)
        qtype = GGMLQuantizationType[kind]
        block, size = GGML_QUANT_SIZES[qtype]
        start = g.tensors[_index(g, name)].offset
        for at in range(0, size, 2):
            for case, half in BFLOAT if kind == "BF16" else HALF:
                data = g.data[:start + at] + half + g.data[start + at + 2:]
                one = np.frombuffer(data[start:start + size], np.uint8).reshape(1, size)
                with np.errstate(all="ignore"):
                    bad = not np.isfinite(dequantize(one, qtype)).all()
                yield (f"{kind} byte {at} {case}", write(replace(g, data=data)), (name,), bad)


def test_every_non_finite_scale_of_every_block_type_is_refused_naming_its_tensor(tmp_path):
    cases = list(block_scale_cases(tmp_path))
    refused = [(case, data, names) for case, data, names, bad in cases if bad]
    # The NaN of each other byte: its bits among a block's integers are still weights.
    accepted = [(case, data) for case, data, _, bad in cases
                if not bad and case.endswith("NaN")]
    # Every type has a scale (its first float16, or Q6_K's and Q3_K's last) among them.
    assert {c.split()[0] for c, *_ in refused} == set(QUANTISED)
    assert (len(cases), len(refused)) == (1_269, 51), (len(cases), len(refused))
    with warnings.catch_warnings():  # numpy's "invalid value" would be a second line
        warnings.simplefilter("error")
        assert refused_all(tmp_path, refused, load=read_gemma3) == []
    for case, data in accepted:
        path = tmp_path / "accepted.gguf"
        path.write_bytes(data)
        assert read_gemma3(path).config.n_layer == 1, case


def layout_cases(g: GGUF):
    """For every tensor: its type changed to every other type kvcache reads (so its bytes
    no longer match its shape, or its rows are not whole blocks), and its shape a row
    shorter or longer than its bytes; and for every block type, rows not whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {k: GGML_QUANT_SIZES[GGMLQuantizationType[k]] for k in TENSOR_TYPES}
    for i, t in enumerate(g.tensors):
        name = t.name.decode()
        kind = GGMLQuantizationType(t.kind).name
        width = t.dims[0]
        for other in TENSOR_TYPES:
            (b, n), (b0, n0) = sizes[other], sizes[kind]
            if other == kind or (width % b == 0 and width // b * n == width // b0 * n0):
                continue  # the same bytes a row (F16 and BF16): not a lie a reader can see
            value = GGMLQuantizationType[other].value
            yield f"{name} as {other}", write(g.with_tensor(i, kind=value)), (name,)
        rows = t.dims[1] if len(t.dims) > 1 else None
        if rows:
            for case, n in [("a row short", rows - 1), ("a row long", rows + 1)]:
                dims = (width, n) + t.dims[2:]
                yield f"{name} {case}", write(g.with_tensor(i, dims=dims)), (name,)
    i = _index(g, "blk.0.attn_output.weight")
    t = g.tensors[i]
    for kind in QUANTISED:
        block = sizes[kind][0]
        value = GGMLQuantizationType[kind].value
        for width in sorted({1, block // 2, block - 1, block + 1, 3 * block // 2} - {block}):
            if width % block:
                dims = (width,) + t.dims[1:]
                yield (f"{kind} rows of {width}", write(g.with_tensor(i, kind=value, dims=dims)),
                       (t.name.decode(), kind))


def test_every_tensor_whose_bytes_do_not_match_its_shape_and_type_is_refused(gemma_base,
                                                                             tmp_path):
    cases = list(layout_cases(gemma_base))
    assert len(cases) == 241, len(cases)
    assert refused_all(tmp_path, cases, load=read_gemma3) == []


def gemma_metadata_cases(g: GGUF):
    """Every gemma3.* key the config reads, given each value its type cannot take; the
    window 0, negative or past the context; the layer pattern the wrong length, not
    booleans, or 0; a rotary base missing or not finite; a required key missing."""
    layers = GEMMA["n_layer"]
    whole = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "context_length", "attention.key_length",
             "attention.sliding_window", "attention.sliding_window_pattern"]
    for key in whole:
        for case, value in NOT_WHOLE + [("0", Value(U32, 0))]:
            if key.endswith("pattern") and case in ("array", "empty array"):
                continue  # an array is the pattern's other spelling: below
            yield f"gemma3.{key}={case}", write(g.with_value(f"gemma3.{key}", value)), ()
    for key in ["rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon"]:
        for case, value in NOT_POSITIVE:
            yield f"gemma3.{key}={case}", write(g.with_value(f"gemma3.{key}", value)), (
                f"gemma3.{key}",)
    window = "gemma3.attention.sliding_window"
    for case, n in [("context + 1", GEMMA["context"] + 1), ("2^20 + 1", 2**20 + 1)]:
        yield f"{window}={case}", write(g.with_value(window, Value(U64, n))), (window,)
    pattern = "gemma3.attention.sliding_window_pattern"
    for n in (0, layers + 1, 2 * layers + 5):
        value = Value(ARRAY, [True] * n, BOOL)
        yield f"{pattern} of {n} layers", write(g.with_value(pattern, value)), (pattern,)
    for case, value in [("numbers", Value(ARRAY, [1] * layers, U32)),
                        ("text", Value(ARRAY, [b"sliding"] * layers, STRING))]:
        yield f"{pattern} of {case}", write(g.with_value(pattern, value)), (pattern,)
    for key in ["general.architecture", "tokenizer.ggml.tokens", "gemma3.rope.freq_base",
                window, *(f"gemma3.{k}" for k in whole[:4] + ["context_length"]),
                "gemma3.attention.layer_norm_rms_epsilon"]:
        yield f"{key} missing", write(g.with_value(key, None)), (key,)
    for case, value in [("llama", b"llama"), ("gemma2", b"gemma2"), ("empty", b"")]:
        yield f"architecture {case}", write(g.with_value(
            "general.architecture", Value(STRING, value))), ("general.architecture",)
    for case, value in [("8 tokens", 8), ("a token more", GEMMA["vocab"] + 1)]:
        yield f"vocab_size {case}", write(g.with_value(
            "gemma3.vocab_size", Value(U32, value))), ()
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        yield f"{key} past the vocabulary", write(g.with_value(
            key, Value(U32, GEMMA["vocab"]))), (key,)
    for key, value in [("gemma3.attention.value_length", Value(U32, 64)),
                       ("gemma3.rope.scaling.type", Value(STRING, b"linear"))]:
        yield f"{key} changed", write(g.with_value(key, value)), (key,)


def test_every_hostile_gemma3_key_is_refused_naming_it(gemma_base, tmp_path):
    cases = list(gemma_metadata_cases(gemma_base))
    assert len(cases) == 165, len(cases)
    assert refused_all(tmp_path, cases, load=read_gemma3) == []


def test_a_qk_norm_of_any_width_but_the_head_size_is_refused_naming_it(tmp_path):
    hs, C = GEMMA["head_dim"], GEMMA["n_embd"]
    cases = []
    for name in ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"):
        for width in (1, hs // 2, hs - 2, hs + 2, 2 * hs, C + 1):
            path = gemmakit.write_tiny_gemma3(tmp_path / "norm.gguf", shapes={name: (width,)},
                                              t=GEMMA)
            cases.append((f"{name} of {width}", path.read_bytes(), (name, f"({hs},)")))
    assert refused_all(tmp_path, cases, load=read_gemma3) == []


def test_the_tiny_gemma3_reads(gemma_base, tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(write(gemma_base))
    model = read_gemma3(path)
    assert [(t.window, t.rope_theta) for t in model.config.layer_types] == [
        (GEMMA["window"], 10_000.0)]
    assert len(model.tensors) == 2 + 13
