"""A LoRA run's store: the frozen base's compute weights alone, written once, never per step; the planner and
the resource check count exactly the files, and the store's byte counters equal the planner's per step."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layers import GPTJConfig
from memory_model import PlanConfig, device_spec, plan
from memory_model.planner import step_disk_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.errors import StoreError
from streamer.resources import DISK_HEADROOM, RAM_HEADROOM, HostNeed
from streamer.store.slabfile import TRAILER_BYTES
from streamer.store.spec import StoreSpec

CFG = GPTJConfig.preset("gptj-debug")
ES = {"bf16": 2, "fp32": 4}


def _lora(store: str, dtype: str, **extra: object) -> TrainerConfig:
    return TrainerConfig.of(store=store, dtype=dtype, lora_rank=4, update_chunk=20_000, **extra)


def _batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (2, 16), generator=generator) for _ in range(n)]


def _state_files(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "slabs").iterdir()}


def _with_headroom(nbytes: int, headroom: tuple[int, float]) -> int:
    return nbytes + headroom[0] + int(nbytes * headroom[1]) if nbytes else 0


@pytest.mark.parametrize("store,dtype", [("disk", "bf16"), ("disk", "fp32"), ("ram", "bf16"), ("ram", "fp32")])
def test_a_lora_store_holds_the_bases_compute_weights_alone(tmp_path: Path, store: str, dtype: str) -> None:
    tc, root = _lora(store, dtype), tmp_path / "run"
    with StreamingTrainer(CFG, tc, store_dir=root) as trainer:
        base = trainer.state_dict(merged=False)
        trainer.step(_batches(1)[0])
        trainer.save()
        files = _state_files(root)
        for _ in range(2):
            trainer.step(_batches(1)[0])
            trainer.save()
            assert _state_files(root) == files  # neither a step nor a save writes the base again
        assert all(torch.equal(v, base[k]) for k, v in trainer.state_dict(merged=False).items())
    params = CFG.num_params()
    assert sorted(files) == sorted(f"{unit}.1.state" for unit in CFG.unit_names())  # no gradient file
    assert sum(files.values()) == params * ES[dtype] + len(files) * TRAILER_BYTES
    ram, disk = tc.store_spec(CFG).host_bytes()
    assert disk == sum(files.values())
    assert ram == (params * ES[dtype] if store == "ram" else 0)
    planned = plan(CFG, device_spec("h100-sxm"), PlanConfig.of(batch=2, seq=16, compute_dtype=dtype, store=store,
                                                               lora=tc.lora), limits=False)
    assert planned.host_store_bytes == params * ES[dtype]
    need = HostNeed.of(CFG, tc, stores_on_disk=1, stores_in_ram=1)
    assert (need.ram, need.disk) == (_with_headroom(ram, RAM_HEADROOM), _with_headroom(disk, DISK_HEADROOM))


@pytest.mark.parametrize("accum,dtype,prefetch", [(1, "bf16", 1), (2, "fp32", 2), (1, "bf16", 0)])
def test_lora_store_bytes_per_step_are_the_planners(tmp_path: Path, accum: int, dtype: str, prefetch: int) -> None:
    tc = _lora("disk", dtype, grad_accum=accum, prefetch=prefetch)
    config = PlanConfig.of(batch=2, seq=16, compute_dtype=dtype, grad_accum=accum, prefetch=prefetch, store="disk",
                           lora=tc.lora)
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "run") as trainer:
        for ids in _batches(2):
            trainer.step(ids)
            assert trainer.step_bytes == step_disk_bytes(CFG, config)
    assert step_disk_bytes(CFG, config)[1] == 0
    # Each unit's weights are read for its forward and again for its backward, but the head's once (it stays
    # from its forward into its backward) and the embedding's once (no backward: its input is token ids).
    once = CFG.params().own("embed") + CFG.params().own("head")
    assert step_disk_bytes(CFG, config)[0] == ES[dtype] * accum * (2 * CFG.num_params() - once)


def test_a_ram_tier_lora_run_resumes_from_its_saved_base(tmp_path: Path) -> None:
    tc, root = _lora("ram", "fp32", lr=1e-2), tmp_path / "run"
    ids = _batches(3)
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "straight") as straight:
        losses = [straight.step(batch) for batch in ids]
    with StreamingTrainer(CFG, tc, store_dir=root) as first:
        first.step(ids[0])
        first.save()
    with StreamingTrainer.open(root) as resumed:
        assert resumed.store.spec.frozen and resumed.step_count == 1
        assert [resumed.step(batch) for batch in ids[1:]] == losses[1:]
    with pytest.raises(StoreError, match="frozen base only; resume it with its --lora-rank"):
        StreamingTrainer.open(root, {"lora_rank": 0})


def test_a_store_written_before_frozen_existed_opens_as_a_full_store() -> None:
    spec = StoreSpec(CFG)
    raw = spec.to_dict()
    del raw["frozen"]
    assert StoreSpec.from_dict(raw) == spec and not spec.frozen


def test_from_pretrained_with_lora_stores_no_optimizer_state(tmp_path: Path, tiny_hf_model) -> None:
    hf = tmp_path / "hf"
    model = tiny_hf_model(CFG)
    model.save_pretrained(hf)
    with StreamingTrainer.from_pretrained(hf, _lora("disk", "bf16"), store_dir=tmp_path / "run") as trainer:
        assert trainer.store.spec.stored_kinds() == ("compute",)
        loaded = trainer.state_dict(merged=False)
    assert sum(_state_files(tmp_path / "run").values()) == CFG.num_params() * 2 + len(CFG.unit_names()) * TRAILER_BYTES
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k].bfloat16().float()) for k, v in loaded.items())  # the base as trained on


@pytest.mark.parametrize("saved, compute, store", [("bfloat16", "bf16", "disk"), ("float16", "bf16", "ram"),
                                                   ("bfloat16", "fp32", "disk")])
def test_a_16_bit_checkpoint_is_imported_exactly_without_widening(tmp_path: Path, tiny_hf_model, saved: str,
                                                                   compute: str, store: str) -> None:
    """A frozen base's import reads each tensor in the checkpoint's own dtype and casts it a chunk at a time
    (chunks of 997 elements here, most across two tensors): the values of the fp32 route it replaced, where a
    16-bit value widened is exact and then cast once."""
    hf = tmp_path / "hf"
    model = tiny_hf_model(CFG).to(getattr(torch, saved))
    model.save_pretrained(hf)
    tc = TrainerConfig.of(store=store, dtype=compute, lora_rank=4, update_chunk=997)
    with StreamingTrainer.from_pretrained(hf, tc, store_dir=tmp_path / "run") as trainer:
        loaded = trainer.state_dict(merged=False)
    expected, dtype = model.state_dict(), {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]
    assert loaded.keys() <= expected.keys()
    assert all(torch.equal(v, expected[k].float().to(dtype).float()) for k, v in loaded.items())


def test_a_frozen_slab_written_in_chunks_of_any_size_is_its_pieces_bytes() -> None:
    """A chunk of a frozen unit's slab casts only its own elements, an element cut by the chunk's edge too; the
    bytes between pieces (their alignment) are zero."""
    from streamer.store.layout import Placed, slab_chunk

    generator = torch.Generator().manual_seed(0)
    placed = [Placed(0, torch.randn(7, generator=generator), torch.bfloat16),
              Placed(16, torch.randn(5, generator=generator).bfloat16(), torch.bfloat16),
              Placed(32, torch.randint(0, 255, (9,), dtype=torch.uint8, generator=generator), torch.uint8),
              Placed(48, torch.randn(3, generator=generator).double(), torch.float32)]
    slab = torch.zeros(64, dtype=torch.uint8)
    for p in placed:
        slab[p.offset:p.end] = p.values.to(p.dtype).view(torch.uint8)
    for size in (1, 3, 5, 16, 17, 64):
        assert torch.equal(torch.cat([slab_chunk(placed, s, min(size, 64 - s)) for s in range(0, 64, size)]), slab)
