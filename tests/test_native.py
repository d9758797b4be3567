"""caches/native.py keys each built kernel by the CPU and the compiler, not by flag text
alone: `-march=native` reads the same on every machine, and a library built for another
CPU's instructions, found in a shared cache folder, would kill the process on load."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from kvcache_cli.caches import code_attention, native


def _fake_compiler(folder: Path, name: str, version: str, march: str) -> str:
    """A compiler driver that only answers `--version` and `-###` (its resolved flags),
    as gcc's does, and fails to compile anything."""
    script = folder / name
    script.write_text(f"""#!/bin/sh
case "$*" in
  --version) echo "{version}" ;;
  *-###*) echo ' /usr/lib/cc1 -E -quiet - "-march={march}" -mavx2 -mtune={march}' >&2 ;;
  *) echo "error: cannot compile" >&2; exit 1 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_library_built_for_another_cpu_is_never_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, "c++", "c++ 12.2.0", "x"))
    monkeypatch.setattr(native, "target", lambda compiler: "c++ 12.2.0\n-march=icelake-server")
    built_there = native.library(code_attention.SOURCE, os.environ["CXX"])
    built_there.parent.mkdir(parents=True)
    built_there.write_bytes(b"AVX-512 code")  # loading it here would fail (or crash)

    monkeypatch.setattr(native, "target", lambda compiler: "c++ 12.2.0\n-march=haswell")
    assert native.library(code_attention.SOURCE, os.environ["CXX"]) != built_there
    lib, why = native.build(code_attention.SOURCE, off="KVCACHE_CODE_ATTENTION")
    assert lib is None and "could not build code_attention.cpp" in why, why


def test_the_key_holds_the_compilers_version_and_the_resolved_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path))
    for folder in ("a", "b", "c"):
        (tmp_path / folder).mkdir()
    gcc12 = _fake_compiler(tmp_path / "a", "c++", "c++ (Debian 12.2.0) 12.2.0", "haswell")
    gcc13 = _fake_compiler(tmp_path / "b", "c++", "c++ (Debian 13.1.0) 13.1.0", "haswell")
    other_cpu = _fake_compiler(tmp_path / "c", "c++", "c++ (Debian 12.2.0) 12.2.0", "znver4")
    assert native.target(gcc12).splitlines()[0] == "c++ (Debian 12.2.0) 12.2.0"
    assert "-march=haswell" in native.target(gcc12) and "-march=znver4" in native.target(other_cpu)
    paths = {native.library(code_attention.SOURCE, c) for c in (gcc12, gcc13, other_cpu)}
    assert len(paths) == 3


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_this_machines_key_names_its_compiler_version():
    key = native.target(shutil.which("c++"))
    head = key.splitlines()[0]
    assert head and any(ch.isdigit() for ch in head), key
    assert len(key.splitlines()) > 1, key  # the resolved CPU, or /proc/cpuinfo's flags


def test_a_library_is_rebuilt_when_a_file_its_source_includes_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "target", lambda compiler: "c++ 12.2.0\n-march=x")
    source = tmp_path / "kernel.cpp"
    source.write_text('#include <vector>\n#include "part.h"  // beside it\nint f();\n')
    (tmp_path / "part.h").write_text("int g();\n")
    before = native.library(source, "c++")
    (tmp_path / "part.h").write_text("int h();\n")
    assert native.library(source, "c++") != before
