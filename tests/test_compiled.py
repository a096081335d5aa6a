"""The opt-in precisions' compiled kernels give the bits their eager runs give, and their C++ kernels on the CPU
(quant.cpp, rounding.cpp) the bits of both.

A chunk of at least `COMPILE_MIN_NUMEL` elements runs compiled; pieces below it run eagerly. Quantizing,
dequantizing and rounding are chunking-free (records per block; random bits per element index), so a large
chunk's result must equal its small pieces' results put together.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from memory_model.units import QUANT_BLOCK, stored_bytes
from streamer import compiled, native
from streamer.runtime import optim
from streamer.runtime.optim import stochastic_round_bf16_
from streamer.store import quant
from streamer.store.quant import decode, encode

BIG = compiled.COMPILE_MIN_NUMEL + 3 * QUANT_BLOCK + 100  # a partial last block too
PIECE = compiled.COMPILE_MIN_NUMEL // 4


def _values(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3


def _encoded_in_pieces(values: torch.Tensor, signed: bool) -> torch.Tensor:
    return torch.cat([encode(values[lo:lo + PIECE], signed, torch.empty(stored_bytes("int8", min(PIECE, BIG - lo)),
                                                                         dtype=torch.uint8))
                      for lo in range(0, values.numel(), PIECE)])


@pytest.fixture
def without_cpp(monkeypatch):
    """The int8 moments quantized by the compiled kernels, as where quant.cpp cannot be built."""
    monkeypatch.setattr(quant, "_native", lambda values, raw: None)


@pytest.mark.parametrize("signed", [True, False])
def test_compiled_int8_codes_equal_eager_ones(signed, without_cpp):
    values = _values(BIG, 0)
    values = values if signed else values * values
    raw = encode(values, signed, torch.empty(stored_bytes("int8", BIG), dtype=torch.uint8))
    assert quant._encode_blocks._compiled is not None, "the large chunk did not run compiled"
    assert torch.equal(raw, _encoded_in_pieces(values, signed))
    whole = decode(raw, signed, torch.empty(BIG))
    assert quant._decode_blocks._compiled is not None
    pieces = [decode(raw[stored_bytes("int8", lo):stored_bytes("int8", lo + PIECE)], signed,
                     torch.empty(min(PIECE, BIG - lo))) for lo in range(0, BIG, PIECE)]
    assert torch.equal(whole, torch.cat(pieces))


def _compiled_encode(values: torch.Tensor, signed: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(quant, "_native", lambda values, raw: None)
        return encode(values, signed, torch.empty(stored_bytes("int8", values.numel()), dtype=torch.uint8))


@pytest.mark.parametrize("signed", [True, False])
def test_the_cpp_int8_kernels_give_the_compiled_ones_bits(signed, monkeypatch):
    """Scales and codes of a large chunk (zero blocks, a tiny value, a partial last block), and of every 997th fp32
    bit pattern in [-1, 1], each of the map's midpoints and the floats either side of it, and both zeros, under a
    scale of exactly 1 (each block's first value is 1): quant.cpp's one look-up gives the codes of the compiled
    kernel's two. Dequantized, the values are the same too."""
    values = _values(BIG, 2)
    values = values if signed else values * values
    values[QUANT_BLOCK:3 * QUANT_BLOCK] = 0.0
    values[5 * QUANT_BLOCK] = 1e-30
    patterns = torch.arange(-2**31, 2**31 - 1, 997, dtype=torch.int64).to(torch.int32).view(torch.float32)
    qmap = torch.tensor(quant.dynamic_map(signed))
    mids = (qmap[:-1] + qmap[1:]) / 2
    edges = torch.cat([mids, mids.nextafter(qmap[1:]), mids.nextafter(qmap[:-1]), torch.tensor([0.0, -0.0])])
    patterns = torch.cat([edges, patterns[patterns.abs() <= 1]])
    patterns = patterns[:patterns.numel() // QUANT_BLOCK * QUANT_BLOCK].clone()
    patterns.view(-1, QUANT_BLOCK)[:, 0] = 1.0
    assert patterns.numel() > 2_000_000 and bool((patterns < 0).any()) and bool((patterns == 0).any())
    assert quant._LIBRARY.get() is not None, "quant.cpp was not built"
    for chunk in (values, patterns):
        ours = encode(chunk, signed, torch.empty(stored_bytes("int8", chunk.numel()), dtype=torch.uint8))
        assert torch.equal(ours, _compiled_encode(chunk, signed, monkeypatch))
        back = decode(ours, signed, torch.empty(chunk.numel()))
        with monkeypatch.context() as patch:
            patch.setattr(quant, "_native", lambda values, raw: None)
            assert torch.equal(back, decode(ours, signed, torch.empty(chunk.numel())))


def test_int8_kernels_that_cannot_be_built_leave_the_compiled_ones_with_one_warning(monkeypatch):
    def no_compiler(source, flags=()):
        raise OSError("no C++ compiler: install one (g++) or set CXX")

    monkeypatch.setattr(native, "built", no_compiler)
    monkeypatch.setattr(quant._LIBRARY, "_loaded", [])
    values = _values(5000, 3)
    expected = _compiled_encode(values, True, monkeypatch)
    out = torch.empty(stored_bytes("int8", values.numel()), dtype=torch.uint8)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ kernels could not be built \(no C\+\+ compiler: install one"):
        assert torch.equal(encode(values, True, out), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(encode(values, True, out), expected)


def test_the_cpp_rounding_gives_the_compiled_kernels_bits(monkeypatch):
    values = _values(BIG, 1)
    key, start = optim.rounding_key(3, 7, "block.1"), 2**32 - 5000  # the element index wraps inside the chunk
    assert optim._ROUNDING.get() is not None, "rounding.cpp was not built"
    ours = values.clone()
    stochastic_round_bf16_(ours, key, start)
    monkeypatch.setattr(optim._ROUNDING, "get", lambda: None)
    theirs = values.clone()
    stochastic_round_bf16_(theirs, key, start)
    assert optim._round_stochastically._compiled is not None
    assert torch.equal(ours, theirs)


def test_compiled_stochastic_rounding_equals_eager(monkeypatch):
    monkeypatch.setattr(optim._ROUNDING, "get", lambda: None)  # as where rounding.cpp cannot be built
    values = _values(BIG, 1)
    key, start = optim.rounding_key(3, 7, "block.1"), 2**32 - 5000  # the element index wraps inside the chunk
    whole = values.clone()
    stochastic_round_bf16_(whole, key, start)
    assert optim._round_stochastically._compiled is not None
    pieces = values.clone()
    for lo in range(0, BIG, PIECE):
        stochastic_round_bf16_(pieces[lo:lo + PIECE], key, start + lo)
    assert torch.equal(whole, pieces)
    assert not torch.equal(whole, values) and torch.equal(whole, whole.bfloat16().float())


def test_a_kernel_that_cannot_compile_runs_eagerly_with_one_warning(monkeypatch):
    def broken(fn, **_):
        def run(*args, **kwargs):
            raise RuntimeError("no C++ compiler\nmore detail")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    doubled = compiled.Kernel(lambda x: x * 2)
    x = torch.ones(compiled.COMPILE_MIN_NUMEL)
    with pytest.warns(RuntimeWarning, match=r"torch.compile failed .*\(no C\+\+ compiler\); it runs eagerly"):
        assert torch.equal(doubled(x.numel(), x), x * 2)
    assert not doubled.compiles(x.numel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(doubled(x.numel(), x), x * 2)


@pytest.mark.parametrize("given", [None, "default", "inherited", "mine"])
def test_each_cpu_capability_compiles_into_its_own_cache(monkeypatch, tmp_path, given):
    """A kernel cached under one capability crashed a process capped to another: the default cache folder is
    split by capability, also where a parent process chose another capability's; a folder the user names is
    kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    named = {None: None, "default": default_cache_dir(), "inherited": str(Path(default_cache_dir()) / "AVX512"),
             "mine": str(tmp_path)}[given]
    if named is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", named)
    compiled.separate_cache_per_isa()
    expected = str(tmp_path) if given == "mine" else str(Path(default_cache_dir()).absolute() / "AVX2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected
