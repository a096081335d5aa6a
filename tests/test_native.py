"""streamer.native: C++ sources built once per source, torch, flags and (for -march=native) CPU, into the user's
cache folder."""
from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import pytest

from streamer import native

SOURCE = 'extern "C" int ws_answer() { return 42; }\n'


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "answer.cpp"
    path.write_text(SOURCE)
    return path


def test_a_library_is_built_once_and_named_by_its_flags_and_cpu(source, monkeypatch):
    first = native.built(source, native.KERNEL_FLAGS)
    assert first.parent == source.parent / "cache" / "weight-streaming"
    assert ctypes.CDLL(str(first)).ws_answer() == 42
    built_at = first.stat().st_mtime_ns
    assert native.built(source, native.KERNEL_FLAGS) == first and first.stat().st_mtime_ns == built_at
    assert native.built(source) != first  # other flags
    monkeypatch.setattr(native, "_cpu_features", lambda: "flags: another CPU's")
    assert native.built(source, native.KERNEL_FLAGS) != first
    assert native.built(source) == native.built(source)  # portable flags: any CPU's


def test_a_library_that_cannot_be_built_warns_once_and_leaves_none(source, monkeypatch):
    monkeypatch.setenv("CXX", "/bin/false")
    library = native.Library(source, (), {"ws_answer": []}, "the answer", "we guess instead")
    with pytest.warns(RuntimeWarning, match=r"^the answer could not be built \(/bin/false failed: 1\); we guess"):
        assert library.get() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert library.get() is None
