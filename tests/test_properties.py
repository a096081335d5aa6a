"""Property tests: no input makes the store's readers fail with anything but the project's own errors.

The model config, size parser, data loader and checkpoint reader have theirs beside their unit tests
(tests/test_layers.py, test_devices.py, test_data.py, test_hf.py); these cover what a run directory holds:
the store spec, the manifest, the journal, the slab trailers and the trainer settings.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layers import GPTJConfig
from streamer import StoreError, StreamerError, StreamingTrainer, TrainerConfig
from streamer.store.slabfile import TRAILER_BYTES, Trailer
from streamer.store.host import HostStore
from streamer.store.spec import StoreSpec

CFG = GPTJConfig.preset("gptj-debug")
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    """A committed disk-tier store, and one whose step 2 is journaled with its update unfinished."""
    root = tmp_path_factory.mktemp("stores")
    tc = TrainerConfig.of(store="disk", dtype="bf16", update_chunk=8192)
    data = torch.randint(0, CFG.vocab_size, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(CFG, tc, store_dir=root / "committed") as trainer:
        trainer.step(data[0])
    shutil.copytree(root / "committed", root / "journaled")
    with StreamingTrainer.open(root / "journaled") as trainer:
        trainer.store.finish_step = lambda *_: None  # stop after the update: the journal stays, units at step 2
        trainer.step(data[1])
    return {"committed": root / "committed", "journaled": root / "journaled"}


def _mutate(value: Any, path: list[str | int], new: Any, delete: bool) -> Any:
    """`value` with the item at `path` replaced by `new` (or deleted); a path that does not exist stops early."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(value, dict) and isinstance(key, str) and key in value:
        out = dict(value)
        if delete and not rest:
            del out[key]
        else:
            out[key] = _mutate(value[key], rest, new, delete)
        return out
    return value


def _paths(value: Any, prefix: list[str]) -> list[list[str]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, prefix + [key])
    return out


def _open_copy(source: Path, name: str, edit: Any) -> None:
    """Open a copy of `source` whose file `name` was edited: it opens, or fails with a StoreError."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        shutil.copytree(source, root)
        original = json.loads((root / name).read_text())
        del original["checksum"]  # each field's own check, as for a record written before records had one
        (root / name).write_text(edit(original))
        try:
            HostStore.open(root).close()
        except StoreError:
            pass


def _open_with_config(source: Path, root: Path, key: str, value: int) -> None:
    """Open a copy at `root` of the store `source` whose manifest sets its model's `key` to `value`."""
    shutil.copytree(source, root)
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["checksum"]  # the config's own checks, as for a manifest written before manifests had one
    manifest["spec"]["config"][key] = value
    (root / "manifest.json").write_text(json.dumps(manifest))
    HostStore.open(root).close()


@pytest.mark.parametrize("vocab_size, error", [
    (2**55, "store spec is malformed .*more than any machine holds"),
    (2**63, "store spec is malformed .*more than any machine holds"),
    (2**28, r"unit embed: state file .* bytes, expected \d+ \(truncated or from another run\)")])
def test_a_manifest_naming_a_far_larger_model_is_refused_before_allocating(run_dirs, tmp_path, monkeypatch,
                                                                          vocab_size, error):
    """Hypothesis found the first two (torch overflowed sizing the embedding). The third must be refused by the
    state files' sizes before any RAM slab is allocated: a RAM-tier store of its model is hundreds of GB."""
    def allocating(*args: object, **kwargs: object) -> None:
        raise AssertionError("RAM slabs allocated before the state files' sizes were checked")
    monkeypatch.setattr("streamer.store.host.RamSlabs", allocating)
    with pytest.raises(StoreError, match=error):
        _open_with_config(run_dirs["committed"], tmp_path / "run", "vocab_size", vocab_size)


def test_a_manifest_naming_a_far_deeper_model_is_refused_before_its_layouts_are_built(run_dirs, tmp_path,
                                                                                       monkeypatch):
    """Hypothesis found it: a depth of millions had the store build every unit's layout (minutes, and GBs)
    before it compared the model's units with the manifest's."""
    def building(*args: object, **kwargs: object) -> None:
        raise AssertionError("unit layouts built before the manifest's units were checked")
    monkeypatch.setattr("streamer.store.spec.model_layouts", building)
    with pytest.raises(StoreError, match="num_hidden_layers 1,000,000,000 is more than 2,048"):
        _open_with_config(run_dirs["committed"], tmp_path / "run", "n_layer", 10**9)


@SETTINGS
@given(data=st.data(), new=JSON, delete=st.booleans(), replace_all=st.booleans())
def test_any_manifest_opens_or_is_a_store_error(run_dirs, data, new, delete, replace_all):
    def edit(manifest: dict) -> str:
        if replace_all:
            return json.dumps(new)
        path = data.draw(st.sampled_from(_paths(manifest, [])[1:]))
        return json.dumps(_mutate(manifest, path, new, delete))
    _open_copy(run_dirs["committed"], "manifest.json", edit)


@SETTINGS
@given(data=st.data(), new=JSON, delete=st.booleans(), garbage=st.binary(max_size=40))
def test_any_journal_opens_or_is_a_store_error(run_dirs, data, new, delete, garbage):
    def edit(journal: dict) -> str:
        path = data.draw(st.sampled_from([p for p in _paths(journal, [])[1:] if p[:1] != ["trainer"] or len(p) == 1]))
        text = json.dumps(_mutate(journal, path, new, delete))
        return text if not garbage else text[:len(garbage)] + garbage.decode(errors="replace")
    _open_copy(run_dirs["journaled"], "journal.json", edit)


@SETTINGS
@given(raw=st.one_of(JSON, st.fixed_dictionaries({
    "config": st.one_of(JSON, st.just(CFG.__dict__)),
    "compute_dtype": st.one_of(JSON, st.sampled_from(["fp32", "bf16", "fp16"])),
    "moment_dtype": st.one_of(JSON, st.sampled_from(["fp32", "bf16"])),
    "placement": st.one_of(JSON, st.fixed_dictionaries({k: st.sampled_from(["ram", "disk", "nvme"])
                                                         for k in ("compute", "state", "grad")})),
    "chunk": st.one_of(JSON, st.integers(-5, 2**40))})))
def test_store_spec_from_any_dict_is_a_spec_or_a_store_error(raw):
    try:
        spec = StoreSpec.from_dict(raw)
    except StoreError:
        return
    assert StoreSpec.from_dict(spec.to_dict()) == spec


@SETTINGS
@given(tail=st.binary(min_size=0, max_size=2 * TRAILER_BYTES), keep_magic=st.booleans())
def test_any_file_tail_is_a_trailer_or_a_store_error(tail, keep_magic):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "block.0.1.state"
        if keep_magic and len(tail) >= TRAILER_BYTES:  # past the magic: any unit name, generation, size, checksum
            tail = tail[:-TRAILER_BYTES] + b"WSSLAB01" + tail[-TRAILER_BYTES + 8:]
        path.write_bytes(tail)
        try:
            trailer = Trailer.read(path, "block.0")
        except StoreError as exc:
            assert "block.0" in str(exc)
            return
        assert isinstance(trailer.unit, str) and trailer.generation >= 0


_VALID = TrainerConfig().to_dict()


@SETTINGS
@given(raw=st.dictionaries(st.sampled_from([*_VALID, "bogus"]), JSON | st.sampled_from(list(_VALID.values())),
                           max_size=6),
       schedule=st.one_of(st.none(), st.dictionaries(st.sampled_from(["kind", "warmup_steps", "total_steps",
                                                                      "min_lr_ratio", "x"]), JSON, max_size=4)))
def test_trainer_config_from_any_dict_is_a_config_or_a_config_error(raw, schedule):
    """What a manifest's trainer state may hold: a TrainerConfig, or an error the CLI prints as one line."""
    if schedule is not None:
        raw["schedule"] = schedule
    try:
        tc = TrainerConfig.from_dict(raw)
    except StreamerError:
        return
    # written with the compute dtype resolved, so that a resumed run keeps it
    assert TrainerConfig.from_dict(tc.to_dict()) == tc.replace(dtype=tc.to_dict()["dtype"])
