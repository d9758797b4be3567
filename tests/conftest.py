"""Fixtures shared by the PyTorch test modules."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_conversion_cache(tmp_path_factory):
    """Every test, and every command a test runs in a subprocess, converts GGUF files into a
    temporary cache ($KVCACHE_CACHE), never the user's own: the suite once left its tiny-*
    folders in ~/.cache/kvcache/converted. One for the session, so SmolLM2 is converted once."""
    root = tmp_path_factory.mktemp("kvcache-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCACHE_CACHE", str(root))
        yield root


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Every in-process command sees a machine with its cores free, as a user's quiet one:
    how busy the test machine is must not add a thread note to what a test compares.
    (test_first_run.py shows the note on a busy one.)"""
    monkeypatch.setattr("kvcache_cli.measure.free_cores", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's torch code on one thread, and restore the count afterwards.

    A 64-wide test model gains nothing from a second thread, and when the 2 cores
    are busy, OpenMP's waits for a second thread make every small forward many
    times slower.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a model is loaded: bad input must be refused before one is."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("kvcache_cli.models.gpt2.load_gpt2", refuse)
    monkeypatch.setattr("kvcache_cli.models.llama_loading.load_llama", refuse)
