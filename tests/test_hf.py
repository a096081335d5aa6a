"""HF GPT-J checkpoints: read what transformers writes, write what transformers reads, reject the rest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from layers import GPTJConfig
from streamer.errors import CheckpointError, StreamerError
from streamer.io.hf import HFCheckpoint, HFExporter, expected_tensors

TINY = dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4)


@pytest.fixture(scope="module")
def hf_model(tiny_hf_model) -> transformers.GPTJForCausalLM:
    return tiny_hf_model(GPTJConfig(**TINY))


@pytest.fixture(scope="module")
def hf_state(hf_model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def single_dir(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("single")
    hf_model.save_pretrained(path)
    return path


def _write_config(path: Path, **overrides: object) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**GPTJConfig(**TINY).adapter().to_hf(), **overrides}))


def _write_safetensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    _write_config(path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def _assert_reads(path: Path, state: dict[str, torch.Tensor]) -> None:
    with HFCheckpoint.open(path) as ckpt:
        ckpt.validate()
        assert sorted(ckpt.keys()) == sorted(state)
        seen = []
        for key, tensor in ckpt.iter_tensors():
            assert ckpt.shape(key) == tuple(state[key].shape)
            assert tensor.dtype == torch.float32 and torch.equal(tensor, state[key]), key
            seen.append(key)
        assert sorted(seen) == sorted(state)


def test_reads_single_safetensors(single_dir, hf_state):
    assert (single_dir / "model.safetensors").is_file()
    _assert_reads(single_dir, hf_state)
    assert HFCheckpoint.open(single_dir).config == GPTJConfig(**TINY)


def test_reads_sharded_safetensors(hf_model, hf_state, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    _assert_reads(tmp_path, hf_state)


def test_reads_pytorch_bin_single_and_sharded(hf_state, tmp_path):
    _write_config(tmp_path / "one")
    torch.save(hf_state, tmp_path / "one" / "pytorch_model.bin")
    _assert_reads(tmp_path / "one", hf_state)

    sharded = tmp_path / "two"
    _write_config(sharded)
    keys = sorted(hf_state)
    halves = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, part in halves.items():
        torch.save({k: hf_state[k] for k in part}, sharded / name)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_reads(sharded, hf_state)


def test_prefers_safetensors_over_pickle(hf_state, tmp_path):
    _write_safetensors(tmp_path, hf_state)
    torch.save({k: torch.zeros_like(v) for k, v in hf_state.items()}, tmp_path / "pytorch_model.bin")
    _assert_reads(tmp_path, hf_state)


def test_read_casts_and_returns_an_owned_copy(hf_state, tmp_path):
    _write_safetensors(tmp_path, {k: v.to(torch.bfloat16) for k, v in hf_state.items()})
    ckpt = HFCheckpoint.open(tmp_path)
    key = "transformer.wte.weight"
    assert ckpt.dtype(key) == torch.bfloat16
    assert ckpt.read(key).dtype == torch.float32
    first = ckpt.read(key, torch.bfloat16)
    assert torch.equal(first, hf_state[key].to(torch.bfloat16))
    first.zero_()
    assert torch.equal(ckpt.read(key, torch.bfloat16), hf_state[key].to(torch.bfloat16))


def test_ignores_legacy_attention_buffers(hf_state, tmp_path):
    legacy = {**hf_state, "transformer.h.0.attn.bias": torch.ones(1, 1, 32, 32),
              "transformer.h.0.attn.masked_bias": torch.tensor(-1e9)}
    _write_safetensors(tmp_path, legacy)
    _assert_reads(tmp_path, hf_state)


@pytest.mark.parametrize("shard_bytes", [2 * 2**30, 12_000])
def test_export_round_trip_loads_in_transformers(hf_model, single_dir, tmp_path, shard_bytes):
    out = tmp_path / "export"
    with HFCheckpoint.open(single_dir) as ckpt, HFExporter(out, ckpt.config, max_shard_bytes=shard_bytes) as export:
        for key, tensor in ckpt.iter_tensors():
            export.add(key, tensor)
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    shards = len(files)
    assert (shards == 1) == (shard_bytes > 2**20)
    assert (out / "model.safetensors.index.json").is_file() == (shards > 1)
    if shards > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in hf_model.state_dict().values())
        assert files[0] == f"model-00001-of-{shards:05d}.safetensors"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging folder left behind
    loaded, info = transformers.GPTJForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 attn_implementation="eager")
    assert not any(info.values()), info
    # The file round trip is bit-exact; the logits are the same library's, compared at its fp32 noise.
    expected = hf_model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, hf_model(ids).logits, rtol=0, atol=1e-6)


def test_export_bfloat16_records_dtype(hf_state, tmp_path):
    with HFExporter(tmp_path / "bf16", GPTJConfig(**TINY), dtype=torch.bfloat16) as export:
        for key, tensor in hf_state.items():
            export.add(key, tensor)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    ckpt = HFCheckpoint.open(tmp_path / "bf16")
    assert all(ckpt.dtype(k) == torch.bfloat16 for k in ckpt.keys())
    loaded = transformers.GPTJForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16


def test_export_refuses_non_empty_folder_unless_overwrite(hf_state, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="overwrite=True"):
        HFExporter(out, GPTJConfig(**TINY))
    with HFExporter(out, GPTJConfig(**TINY), overwrite=True) as export:
        for key, tensor in hf_state.items():
            export.add(key, tensor)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failed_export_leaves_nothing(hf_state, tmp_path):
    cfg = GPTJConfig(**TINY)
    with pytest.raises(CheckpointError, match="incomplete"):
        with HFExporter(tmp_path / "a", cfg, max_shard_bytes=1000) as export:
            export.add("transformer.wte.weight", hf_state["transformer.wte.weight"])
    with pytest.raises(KeyboardInterrupt):
        with HFExporter(tmp_path / "b", cfg, max_shard_bytes=1000) as export:
            export.add("lm_head.weight", hf_state["lm_head.weight"])
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key,tensor,match", [
    ("transformer.h.9.ln_1.weight", torch.zeros(32), "not a tensor"),
    ("lm_head.bias", torch.zeros(65), "shape"),
    ("lm_head.bias", torch.zeros(64, dtype=torch.int64), "floating point"),
])
def test_export_rejects_bad_tensors(tmp_path, key, tensor, match):
    with pytest.raises(CheckpointError, match=match):
        with HFExporter(tmp_path / "x", GPTJConfig(**TINY)) as export:
            export.add(key, tensor)
    assert list(tmp_path.iterdir()) == []


def test_export_rejects_duplicates(tmp_path):
    with pytest.raises(CheckpointError, match="twice"):
        with HFExporter(tmp_path / "x", GPTJConfig(**TINY)) as export:
            export.add("lm_head.bias", torch.zeros(64))
            export.add("lm_head.bias", torch.zeros(64))


@pytest.mark.parametrize("change,match", [
    (lambda s: s.pop("lm_head.bias"), "missing keys.*lm_head.bias"),
    (lambda s: s.update({"transformer.h.2.ln_1.weight": torch.zeros(32)}), "unexpected keys.*h.2.ln_1"),
    (lambda s: s.update({"lm_head.bias": torch.zeros(63)}), r"wrong shapes.*lm_head.bias: expected \(64,\)"),
    (lambda s: s.update({"lm_head.bias": torch.zeros(64, dtype=torch.int32)}), "lm_head.bias.*int32"),
    (lambda s: s.update({"lm_head.bias": torch.zeros(64, dtype=torch.float64)}), "lm_head.bias.*float64"),
])
def test_validate_names_the_problem(hf_state, tmp_path, change, match):
    state = dict(hf_state)
    change(state)
    _write_safetensors(tmp_path, state)
    with pytest.raises(CheckpointError, match=match):
        HFCheckpoint.open(tmp_path).validate()


def _sharded(tmp_path: Path, state: dict[str, torch.Tensor], shard_of: dict[str, str]) -> Path:
    _write_config(tmp_path)
    save_file(state, str(tmp_path / "model-1.safetensors"), metadata={"format": "pt"})
    weight_map = {k: shard_of.get(k, "model-1.safetensors") for k in state}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("shard,match", [
    ("../evil.safetensors", "not a file inside"),
    ("/etc/passwd", "not a file inside"),
    ("model-2.safetensors", "model-2.safetensors.*missing"),
])
def test_index_cannot_point_outside_or_at_missing_shards(hf_state, tmp_path, shard, match):
    (tmp_path / "evil.safetensors").write_bytes(b"")
    folder = _sharded(tmp_path / "ckpt", hf_state, {"lm_head.bias": shard})
    with pytest.raises(CheckpointError, match=match):
        HFCheckpoint.open(folder)


def test_index_rejects_symlink_escaping_the_folder(hf_state, tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_file({"lm_head.bias": hf_state["lm_head.bias"]}, str(outside))
    folder = _sharded(tmp_path / "ckpt", hf_state, {"lm_head.bias": "link.safetensors"})
    (folder / "link.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="links outside"):
        HFCheckpoint.open(folder)


def test_index_entry_absent_from_its_shard(hf_state, tmp_path):
    folder = _sharded(tmp_path, {k: v for k, v in hf_state.items() if k != "lm_head.bias"}, {})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.bias"] = "model-1.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not hold it"):
        HFCheckpoint.open(folder)


class _NotATensor:
    pass


@pytest.mark.parametrize("write,match", [
    (lambda p: (p / "config.json").write_text("{not json"), "config.json.*not valid JSON"),
    (lambda p: (p / "config.json").write_text('{"vocab_size": 64, "n_layer": 2, "n_embd": 30, "n_head": 4}'),
     "config.json.*divisible"),
    (lambda p: (p / "config.json").write_text('{"vocab_size": 64, "n_embd": 32, "n_head": 4}'),
     "config.json: the gptj config has no n_layer"),
    (lambda p: (p / "config.json").unlink(), "no model config"),
    (lambda p: (p / "model.safetensors").unlink(), "holds no weights"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00garbage"), "not a readable safetensors"),
])
def test_broken_folders(hf_state, tmp_path, write, match):
    _write_safetensors(tmp_path, hf_state)
    write(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        HFCheckpoint.open(tmp_path)


@pytest.mark.parametrize("payload,match", [
    ({"lm_head.bias": _NotATensor()}, "weights-only"),
    ({"lm_head.bias": 3}, "flat dict"),
    ({"state_dict": {"lm_head.bias": torch.zeros(64)}}, "flat dict"),
])
def test_unsafe_or_odd_pickles_are_rejected(tmp_path, payload, match):
    _write_config(tmp_path)
    torch.save(payload, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=match):
        HFCheckpoint.open(tmp_path)


def test_missing_folder_and_unknown_key(single_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        HFCheckpoint.open(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no tensor named"):
        HFCheckpoint.open(single_dir).read("transformer.h.7.ln_1.weight")


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=8)
_CONFIG_FIELDS = ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim", "n_inner",
                  "layer_norm_epsilon", "activation_function", "model_type", "resid_pdrop", "hidden_size", "bogus"]
_SHARD_NAMES = st.sampled_from(["model-1.safetensors", "../evil.safetensors", "/etc/hostname", "", ".", "sub/",
                                "a\x00b", "x" * 300, "model-2.safetensors", "config.json"]) | st.text(max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.one_of(st.just(GPTJConfig(**TINY).adapter().to_hf()),
                        st.dictionaries(st.sampled_from(_CONFIG_FIELDS), _JSON), _JSON),
       index=st.one_of(_JSON, st.fixed_dictionaries({"weight_map": st.dictionaries(
           st.sampled_from(["lm_head.bias", "lm_head.weight", "transformer.wte.weight"]) | st.text(max_size=8),
           _SHARD_NAMES | _JSON, max_size=4)})),
       shard=st.none() | st.binary(max_size=64))
def test_reader_raises_only_checkpoint_errors(hf_state, config, index, shard):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        state = {k: hf_state[k] for k in ("lm_head.bias", "lm_head.weight", "transformer.wte.weight")}
        if shard is None:
            save_file(state, str(folder / "model-1.safetensors"), metadata={"format": "pt"})
        else:
            (folder / "model-1.safetensors").write_bytes(shard)
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            with HFCheckpoint.open(folder) as ckpt:
                for key in ckpt.keys():
                    ckpt.read(key)
                ckpt.validate()
        except StreamerError as exc:
            assert isinstance(exc, CheckpointError) and "\n" not in str(exc)


def test_iter_tensors_holds_one_tensor_at_a_time(tmp_path):
    """Anonymous memory while streaming a sharded 58 MB checkpoint grows by far less than the model."""
    cfg = GPTJConfig(vocab_size=4096, n_positions=64, n_embd=256, n_layer=16, n_head=4, rotary_dim=8)
    with HFExporter(tmp_path / "ckpt", cfg, max_shard_bytes=8 * 2**20) as export:
        for key, meta in expected_tensors(cfg).items():
            export.add(key, torch.ones(meta.shape))
    total = cfg.num_params() * 4
    script = textwrap.dedent(f"""
        import torch
        from streamer.io.hf import HFCheckpoint
        def anon():
            line = next(l for l in open("/proc/self/status") if l.startswith("RssAnon"))
            return int(line.split()[1]) * 1024
        ckpt = HFCheckpoint.open({str(tmp_path / "ckpt")!r})
        start, peak, total = anon(), 0, 0
        for key, tensor in ckpt.iter_tensors():
            total += float(tensor.sum())
            peak = max(peak, anon() - start)
        print(peak)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak = int(result.stdout.split()[-1])
    assert peak < total / 4, f"streaming held {peak / 2**20:.1f} MiB of a {total / 2**20:.1f} MiB checkpoint"


def test_write_failure_is_a_checkpoint_error_and_leaves_nothing(hf_state, tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("streamer.io.hf.save_file", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*free disk space"):
        with HFExporter(tmp_path / "out", GPTJConfig(**TINY)) as export:
            for key, tensor in hf_state.items():
                export.add(key, tensor)
    assert list(tmp_path.iterdir()) == []
