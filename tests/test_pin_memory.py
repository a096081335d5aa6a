"""--pin-memory all|register|staging|none: the staging pool's bound, the resource check's arithmetic, resume
honouring it, and registered slabs locked and unlocked (through a fake cudart).

These run on a CPU: the pool is exercised with pageable buffers and CUDA is only pretended where a setting is
checked; the copies through pinned memory themselves are CUDA-only.
"""
from __future__ import annotations


import pytest
import torch

from conftest import TINY_RUN_MODEL as TINY
from layers import PRESETS
from streamer import persistence
from streamer.config import TrainerConfig
from streamer.advice import planned_host
from streamer.resources import RAM_HEADROOM, HostNeed, shortfall
from streamer.run import RESUMABLE, resolve
from streamer.runtime.transport import StagingPool
from memory_model.step import Placement
from streamer.store.layout import UnitLayout
from streamer.store.spec import STATE_KINDS, StoreSpec
from streamer.trainer import StreamingTrainer


def test_the_staging_pool_never_holds_more_than_its_limit():
    pool = StagingPool(limit=1000, pin=False)
    a, b = pool.take(100, torch.float32), pool.take(100, torch.float32)  # 400 bytes each: pooled
    beyond = pool.take(100, torch.float32)  # 1200 > 1000: pageable, handed out once
    assert pool.pooled_bytes == 800
    small = pool.take(50, torch.float32)  # 200 more fits exactly
    assert pool.pooled_bytes == 1000
    for t in (a, b, beyond, small):
        pool.give_back(t)
    again = [pool.take(100, torch.float32) for _ in range(3)]
    pooled = {a.data_ptr(), b.data_ptr()}
    assert {t.data_ptr() for t in again[:2]} == pooled  # reused, not allocated again
    assert again[2].data_ptr() not in pooled and pool.pooled_bytes == 1000  # the one beyond was dropped
    assert pool.take(50, torch.float32).data_ptr() == small.data_ptr()


def test_staging_bytes_hold_two_units_and_two_chunk_sets():
    spec = StoreSpec(PRESETS["gptj-6b"])
    cfg = PRESETS["gptj-6b"]
    largest = max(UnitLayout.of(cfg, unit).numel for unit in cfg.unit_names())
    assert largest >= cfg.vocab_size * cfg.n_embd  # the embedding or the head, not a block
    assert spec.staging_bytes() == 4 * (2 * largest + 2 * (len(STATE_KINDS) + 1) * spec.chunk)
    ram, _ = spec.host_bytes()
    assert spec.staging_bytes() < ram / 40  # 2.04 GiB against the 101 GiB `all` would pin
    # On the disk tier a load reads the fp32 master, and a fused update keeps one: a third unit.
    disk = StoreSpec(PRESETS["gptj-6b"], placement=Placement.of("disk"))
    assert disk.staging_bytes() == spec.staging_bytes() + 4 * largest


@pytest.fixture
def pretend_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _need(mode: str, device: str = "cuda") -> HostNeed:
    tc = TrainerConfig.of(device=device, dtype="bf16", store="ram", pin_memory=mode)
    return HostNeed.of(PRESETS["gptj-350m"], tc, stores_on_disk=1, stores_in_ram=2)


def test_the_resource_check_counts_the_pool_and_says_what_is_pinned(pretend_cuda):
    tc = TrainerConfig.of(device="cuda", dtype="bf16", store="ram")
    spec = tc.store_spec(PRESETS["gptj-350m"])
    ram, _ = spec.host_bytes()
    staging = spec.staging_bytes()
    needs = {mode: _need(mode) for mode in ("all", "staging", "none")}
    # The same RAM whatever is pinned: two stores (LOCAL_WORLD_SIZE 2) and their pools, with headroom.
    total = 2 * (ram + staging)
    assert {n.ram for n in needs.values()} == {total + RAM_HEADROOM[0] + int(total * RAM_HEADROOM[1])}
    assert needs["all"].pinned == 2 * (ram + staging)
    assert needs["staging"].pinned == 2 * staging
    assert needs["none"].pinned == 0
    cpu = _need("all", device="cpu")  # no pool, nothing pinned without a CUDA device
    assert cpu.pinned == 0 and cpu.ram < needs["none"].ram


def test_the_shortfall_names_the_pinned_bytes(pretend_cuda, tmp_path):
    cfg = resolve({"model": "gptj-1.3b", "store": "ram", "run_dir": str(tmp_path / "r"), "device": "cuda",
                   "dtype": "bf16", "pin_memory": "all"})
    message = shortfall(cfg, cfg.model_config(), 8 * 2**30, 64 * 2**30, tmp_path)
    assert "pinned with --pin-memory all" in message
    assert "pinned" not in shortfall(cfg.replace(pin_memory="none"), cfg.model_config(), 8 * 2**30, 64 * 2**30,
                                     tmp_path)


def test_resume_honours_pin_memory(tmp_path, monkeypatch):
    assert "pin_memory" in RESUMABLE  # it changes no layout: a resume may change it
    tc = TrainerConfig.of(dtype="fp32", store="disk", pin_memory="all")
    StreamingTrainer(TINY, tc, tmp_path / "store").close()
    asked = []
    real = persistence._pin_memory
    monkeypatch.setattr(persistence, "_pin_memory", lambda device, mode: asked.append(mode) or real(device, mode))
    with StreamingTrainer.open(tmp_path / "store") as trainer:  # the store's own setting
        assert trainer.tc.device.pin_memory == "all" and trainer.store.pin_memory == "none"  # a CPU pins nothing
    with StreamingTrainer.open(tmp_path / "store", overrides={"pin_memory": "staging"}) as trainer:
        assert trainer.tc.device.pin_memory == "staging"
    assert asked == ["all", "staging"]


def test_only_cuda_pins():
    assert persistence._pin_memory("cpu", "all") == "none"
    assert persistence._pin_memory("cuda:0", "all") == "all"
    assert persistence._pin_memory("cuda", "staging") == "staging"


def test_offloaded_activations_count_in_host_ram_pinned_on_cuda(pretend_cuda, tmp_path):
    """`--activations offload` keeps every block's input of one micro-batch in host memory: the resource check
    counts it, pinned unless --pin-memory none; a machine with room for the store alone is refused."""
    inputs = 20 * 4 * 2048 * 1024 * 2  # gptj-350m: 20 blocks' (4, 2048, 1024) bf16 inputs, 320 MiB
    tc = TrainerConfig.of(device="cuda", dtype="bf16", store="ram", pin_memory="staging")
    staging = HostNeed.of(PRESETS["gptj-350m"], tc, stores_on_disk=1, stores_in_ram=2)
    offloaded = HostNeed.of(PRESETS["gptj-350m"], tc, stores_on_disk=1, stores_in_ram=2, offloaded=inputs)
    assert offloaded.pinned == staging.pinned + 2 * inputs
    assert offloaded.ram > staging.ram + 2 * inputs
    unpinned = HostNeed.of(PRESETS["gptj-350m"], tc.replace(pin_memory="none"), 1, 2, offloaded=inputs)
    assert unpinned.pinned == 0 and unpinned.ram == offloaded.ram
    cfg = resolve({"model": "gptj-350m", "store": "ram", "run_dir": str(tmp_path / "r"), "device": "cuda",
                   "dtype": "bf16", "batch": 8, "seq": 2048, "grad_accum": 2})
    planned = planned_host(cfg.model_config(), cfg)  # the process at its peak: store, staging, ...
    offload = cfg.replace(activations="offload")
    assert planned_host(cfg.model_config(), offload).total == planned.total + inputs
    assert shortfall(cfg, cfg.model_config(), planned.total, 64 * 2**30, tmp_path) is None
    refused = shortfall(offload, cfg.model_config(), planned.total, 64 * 2**30, tmp_path)
    assert "of RAM (--store ram, 320 MiB of block inputs (--activations offload)" in refused
    assert shortfall(offload, cfg.model_config(), planned.total + inputs, 64 * 2**30, tmp_path) is None


# --- --pin-memory register: the RAM store's slabs locked where they lie --------------------------------------------
class FakeCudart:
    """torch.cuda.cudart() on a CPU: records each cudaHostRegister (pointer, bytes, flags) and cudaHostUnregister;
    `refuse_after` calls succeed, the next returns cudaErrorMemoryAllocation (2)."""

    def __init__(self, refuse_after: int | None = None) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.refuse_after = refuse_after

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.refuse_after is not None and len(self.registered) == self.refuse_after:
            return 2
        self.registered.append((ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def _slabs(store) -> list[torch.Tensor]:
    kinds = store.spec.ram_kinds()
    return [store._slabs.get(unit, kind) for unit in store.layouts for kind in kinds]


def test_register_locks_every_slab_where_it_lies_and_close_unlocks_them(monkeypatch, tmp_path):
    from streamer.store.host import HostStore
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    spec = TrainerConfig.of(dtype="bf16", store="ram").store_spec(TINY)
    store = HostStore.create(tmp_path / "store", spec, pin_memory="register")
    slabs = _slabs(store)
    assert len(slabs) == len(TINY.unit_names()) * len(spec.ram_kinds()) > 0
    # Each slab's own pointer and exact size (no rounding up), default flags; nothing copied, nothing pinned.
    assert sorted(fake.registered) == sorted((s.data_ptr(), s.numel() * s.element_size(), 0) for s in slabs)
    assert not any(s.is_pinned() for s in slabs)
    assert fake.unregistered == []
    store.close()
    assert sorted(fake.unregistered) == sorted(p for p, _, _ in fake.registered)


def test_a_refused_registration_unlocks_the_others_and_names_the_flag(monkeypatch, tmp_path):
    from streamer.errors import StoreError
    from streamer.store.host import HostStore
    fake = FakeCudart(refuse_after=3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    spec = TrainerConfig.of(dtype="bf16", store="ram").store_spec(TINY)
    with pytest.raises(StoreError, match="use --pin-memory staging") as caught:
        HostStore.create(tmp_path / "store", spec, pin_memory="register")
    assert len(str(caught.value).splitlines()) == 1
    assert sorted(fake.unregistered) == sorted(p for p, _, _ in fake.registered) and len(fake.registered) == 3


def test_only_staging_copies_a_ram_slab_on_the_host():
    from streamer.runtime.transport import crosses_directly
    assert {mode: crosses_directly(mode) for mode in ("all", "register", "staging", "none")} == \
        {"all": True, "register": True, "staging": False, "none": True}


def test_the_resource_check_counts_registered_slabs_as_pinned(pretend_cuda):
    assert _need("register").pinned == _need("all").pinned
    assert _need("register").ram == _need("staging").ram


def test_streamer_train_takes_pin_memory_register(tmp_path, tiny_setup):
    """As a user types it; on a CPU nothing is pinned, and config.toml keeps the choice for a CUDA resume."""
    import subprocess
    import sys
    import tomllib
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--model", str(tiny_setup / "config.json"),
                           "--data", str(tiny_setup / "train.txt"), "--tokenizer", str(tiny_setup / "tok"),
                           "--run-dir", str(run), "--steps", "1", "--batch", "2", "--seq", "16", "--dtype", "fp32",
                           "--sample-tokens", "0", "--eval-every", "0", "--pin-memory", "register"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads((run / "config.toml").read_text())["pin_memory"] == "register"
