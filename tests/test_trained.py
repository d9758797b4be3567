"""The shipped byte-level checkpoint (stdlib-bytes) and the recipe that trained it.

The checkpoint loads by name, predicts its held-out text as well as recipe.json says it
did when it was saved, decodes the same tokens with and without a cache, and its held-out
text is exactly the files recipe.json lists as held out. The recipe itself runs a few
steps of a tiny model in seconds and writes a checkpoint that loads like any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from kvcache_cli.breaks.loop import run_break
from kvcache_cli.checkpoints import TRAINED, heldout_bytes, heldout_text, shipped_dir
from kvcache_cli.generate import generate
from kvcache_cli.models.gpt2 import load_gpt2, model_config
from kvcache_cli.models.tokenizer import ByteEncoding, encoding_for
from kvcache_cli.models.training import Recipe, bits_per_byte, save_checkpoint, stdlib_corpus, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((shipped_dir(TRAINED) / "recipe.json").read_text())


@pytest.fixture(scope="module")
def model():
    return load_gpt2(TRAINED).model


def test_shipped_checkpoint_loads_by_name_with_a_byte_tokenizer_and_a_2048_window(model):
    config = model_config(TRAINED)
    assert config == model.config
    assert (config.tokenizer, config.vocab_size, config.block_size) == ("bytes", 256, 2048)
    assert load_gpt2(TRAINED).source == f"checkpoint {TRAINED} (shipped)"


def test_shipped_checkpoint_is_a_few_megabytes():
    size = (shipped_dir(TRAINED) / "model.safetensors").stat().st_size
    assert 1e6 < size < 15e6, size


def test_loading_twice_gives_the_same_logits(model):
    ids = torch.tensor([list(heldout_bytes()[:64])])
    again = load_gpt2(TRAINED).model
    with torch.no_grad():
        torch.testing.assert_close(model(ids, 0), again(ids, 0), rtol=0, atol=0)


def test_heldout_loss_on_the_first_512_bytes_is_what_recipe_json_recorded(model, record):
    ids = torch.frombuffer(bytearray(heldout_bytes()), dtype=torch.uint8)
    bits = bits_per_byte(model, ids[:513])
    # Loose: another torch or thread count sums in another order, far below 0.1 bit.
    assert bits < record["heldout_bits_first_512"] + 0.1, (bits, record)
    counts = torch.bincount(ids.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * p.log2()).sum())  # 4.45 bits: knowing only how often each byte comes
    assert bits < unigram - 0.2, (bits, unigram)


def test_the_model_predicts_long_context_better_than_short(model):
    # The last 512 bytes of a 2048-byte window, with their 1536 bytes of context and
    # without: a model that learned to read far back does better with it.
    ids = torch.frombuffer(bytearray(heldout_bytes()[:2049]), dtype=torch.uint8).long()
    with torch.no_grad():
        full = model(ids[None, :-1], 0)[0, -512:]  # (512, 256)
        cut = model(ids[None, -513:-1], 0)[0]  # (512, 256)
    target = ids[-512:]
    loss = torch.nn.functional.cross_entropy
    assert loss(full, target) < loss(cut, target)


def test_cached_decoding_samples_the_same_bytes_as_uncached(model):
    # Sampled, not greedy: this small model's greedy continuation of code is mostly spaces,
    # and bytes that never vary could not show a difference. The same seed draws the same
    # bytes only if both loops hand the sampler the same distributions.
    prompt = ByteEncoding().encode("def main(")
    runs = {mode: generate(model, prompt, 32, mode, temperature=1.0,
                           generator=torch.Generator().manual_seed(0)).tokens
            for mode in ("naive", "static")}
    assert runs["naive"] == runs["static"]
    assert len(set(runs["static"])) > 5, "the bytes repeat: nothing could differ"


def test_a_break_prompts_the_byte_model_with_text(model):
    result = run_break("stale-cache", model, max_new_tokens=4)
    assert result.prompt_ids == tuple(b"The quick brown fox jumps over the lazy dog")
    assert result.earlier_ids == tuple(b"Once upon a time")
    assert result.max_logit_diff > 0 and result.naive_agrees


def test_heldout_text_is_the_heldout_files_listed_in_recipe_json(record):
    held = [f for f in record["files"] if f["split"] == "heldout"]
    text, at = heldout_bytes(), 0
    for f in held:
        assert hashlib.sha256(text[at:at + f["bytes"]]).hexdigest() == f["sha256"], f["name"]
        at += f["bytes"]
    assert at == len(text) >= 2_000
    trained = {f["sha256"] for f in record["files"] if f["split"] == "train"}
    assert not trained & {f["sha256"] for f in held}
    assert heldout_text().startswith('"""')  # __future__.py, the first file, in sorted order


def test_byte_encoding_round_trips_text_and_replaces_a_cut_character():
    enc, why = encoding_for("bytes")
    assert why is None
    ids = enc.encode("def naïve():")
    assert ids == list("def naïve():".encode())
    assert enc.decode(ids) == "def naïve():"
    assert enc.decode(ids[:7]) == "def na\ufffd"  # half of ï
    with pytest.raises(ValueError, match="token id 300 is not a byte"):
        enc.decode([300])


def test_the_recipe_trains_a_tiny_model_that_loads_as_a_checkpoint(tmp_path):
    recipe = Recipe(n_layer=1, n_head=2, n_embd=32, block_size=64, steps=4, short_len=16,
                    short_batch=2, long_batch=1, warmup=2, eval_every=2, eval_tokens=128)
    corpus = stdlib_corpus()
    model, curve = train(recipe, corpus)
    assert [p.step for p in curve] == [2, 4]
    assert all(p.heldout_bits > 0 for p in curve)
    again, _ = train(recipe, corpus)
    torch.testing.assert_close(model.state_dict(), again.state_dict(), rtol=0, atol=0)
    saved = save_checkpoint(model, tmp_path, recipe, corpus, curve, seconds=1.0)
    loaded = load_gpt2(str(tmp_path)).model
    assert loaded.config == recipe.config()
    ids = torch.tensor([list(corpus.heldout[:32])])
    with torch.no_grad():
        # float32 saved and loaded: the same weights, summed in another order by the
        # loader's (in, out) layout.
        torch.testing.assert_close(loaded(ids, 0), model(ids, 0), rtol=1e-5, atol=1e-5)
    assert saved["heldout_bytes"] == len(corpus.heldout) == len(
        (tmp_path / "heldout.txt").read_bytes())
    # Training on from a loaded checkpoint starts from its weights, not from the seed's.
    on, _ = train(dataclasses.replace(recipe, steps=1, eval_every=1), corpus, init=loaded)
    fresh, _ = train(dataclasses.replace(recipe, steps=1, eval_every=1), corpus)
    wte = "transformer.wte.weight"
    assert (on.state_dict()[wte] - model.state_dict()[wte]).abs().max() < (
        fresh.state_dict()[wte] - model.state_dict()[wte]).abs().max()


def test_cli_generate_encodes_a_text_prompt_as_bytes_and_decodes_the_reply():
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["generate", "def main(", "--model", TRAINED, "-n", "16",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["prompt_ids"] == list(b"def main(")
    assert data["text"] == ByteEncoding().decode(data["tokens"])
    assert data["model"] == f"checkpoint {TRAINED} (shipped)"


def test_cli_bench_runs_the_shipped_checkpoint():
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, [
        "bench", "--model", TRAINED, "--device", "cpu", "--modes", "naive,static",
        "--prompt-len", "16", "--new-tokens", "8", "--repeats", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tokens_agree"], data


@pytest.mark.parametrize("fields, message", [
    (dict(tokenizer="sentencepiece"), "tokenizer 'sentencepiece'; expected gpt2 or bytes"),
    (dict(tokenizer="bytes", vocab_size=300), "tokenizer bytes needs vocab_size 256, not 300"),
])
def test_a_config_naming_a_tokenizer_it_cannot_have_is_refused(tmp_path, fields, message):
    config = json.loads((shipped_dir(TRAINED) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(ValueError, match=message):
        model_config(str(tmp_path))


def test_transformers_reads_the_shipped_checkpoint_to_the_same_logits(model):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(shipped_dir(TRAINED)).eval()
    ids = torch.tensor([list(b"def main(argv):\n    return 0\n")])
    with torch.no_grad():
        # float32, the same weights: only the order of the sums differs.
        torch.testing.assert_close(hf(ids).logits, model(ids, 0), rtol=1e-4, atol=1e-4)
