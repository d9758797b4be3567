"""A model's weights gathered into one mapping the kernel may back with 2 MiB pages
(`models.huge_pages`): the same tensors, values and sharing, in memory advised so."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from llamakit import tiny_hf, write_tiny_gguf
from torch import nn

from kvcache_cli.models import huge_pages, load_model, set_weights_dtype

linux_thp = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="no transparent huge pages on this host")


def _tied_with_a_view() -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"up": nn.Linear(300, 700), "down": nn.Linear(700, 5),
                           "embedding": nn.Embedding(50, 300)})
    model["head"] = nn.Linear(300, 50, bias=False)
    model["head"].weight = model["embedding"].weight  # tied, as a small model's head
    model.register_buffer("table", torch.arange(12.0).view(3, 4).t())  # a view, strided
    return model


def _mapping_of(address: int) -> list[str]:
    """The lines /proc/self/smaps gives for the mapping holding `address`."""
    lines, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        if inside:
            lines.append(line)
    return lines


def test_gathered_tensors_keep_their_objects_values_strides_and_sharing():
    model = _tied_with_a_view()
    tensors = [*model.parameters(), *model.buffers()]
    before = [(t, t.detach().clone(), t.stride()) for t in tensors]
    x = torch.randn(2, 300)
    expected = model["down"](model["up"](x))
    huge_pages.gather(model)
    for (t, values, stride), now in zip(before, [*model.parameters(), *model.buffers()],
                                        strict=True):
        assert now is t and now.stride() == stride and torch.equal(now, values)
    assert model["head"].weight is model["embedding"].weight
    assert torch.equal(model["down"](model["up"](x)), expected)


@linux_thp
def test_gathered_tensors_share_one_mapping_advised_for_huge_pages():
    model = huge_pages.gather(_tied_with_a_view())
    storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(),
                                                        *model.buffers())}
    assert len(storages) == 1
    # The kernel lists the advice as the mapping's flag `hg`.
    flags = [line for line in _mapping_of(storages.pop()) if line.startswith("VmFlags:")]
    assert flags and "hg" in flags[0].split()


def test_without_the_advice_the_weights_stay_where_they_are(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    model = _tied_with_a_view()
    where = [t.data_ptr() for t in model.parameters()]
    huge_pages.gather(model)
    assert [t.data_ptr() for t in model.parameters()] == where


@linux_thp
def test_a_loaded_model_and_each_weight_format_lie_in_one_mapping(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "kvcache-cache"))
    path = write_tiny_gguf(tiny_hf(seed=3, vocab_size=300), tmp_path / "tiny.gguf", "Q8_0")
    model = load_model(str(path)).model
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        for name in ("fp32", "q8_0"):
            set_weights_dtype(model, name)
            tensors = [*model.parameters(), *model.buffers()]
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, name
            assert torch.isfinite(model(ids, 0)).all()
