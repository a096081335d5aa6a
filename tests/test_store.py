"""The host store: file layout, commits that are not journaled, integrity checks on open, disk cost, lock."""
from __future__ import annotations

import errno
import gc
import fcntl
import json
import mmap
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from layers import GPTJConfig
from streamer import Placement, StoreError, StreamingTrainer, TrainerConfig
from streamer.store import direct
from streamer.store.slabfile import TRAILER_BYTES, Trailer
from streamer.store.files import StateFiles
from streamer.store.host import HostReader, HostStore
from streamer.store.spec import StoreSpec
from memory_model.units import Precision

CFG = GPTJConfig.preset("gptj-debug")
DISK = TrainerConfig.of(store="disk", dtype="bf16", update_chunk=8192, lr=3e-3)
JOURNALED = DISK.replace(update_timing="after-backward")  # the update after the backward: gradients on disk


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG.vocab_size, (2, 32), generator=g) for _ in range(n)]


def trained(root: Path, tc: TrainerConfig = DISK, steps: int = 2) -> dict[str, torch.Tensor]:
    with StreamingTrainer(CFG, tc, store_dir=root) as trainer:
        for ids in batches(steps):
            trainer.step(ids)
        trainer.save()
        return trainer.state_dict()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fail_writes_after(monkeypatch, n: int) -> None:
    original, count = os.pwritev, [0]

    def failing(*args: Any) -> int:
        count[0] += 1
        if count[0] > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args)

    monkeypatch.setattr(os, "pwritev", failing)


# --- layout ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,timing", [("bf16", "after-backward"), ("fp32", "after-backward"), ("bf16", "fused")])
def test_disk_layout_is_one_state_file_and_one_gradient_per_unit(tmp_path, dtype, timing):
    # (no clipping: a fused step that clips is made again after the backward, which writes gradient files)
    trained(tmp_path / "run", DISK.replace(dtype=dtype, update_timing=timing, max_grad_norm=0))
    slabs = sorted(p.name for p in (tmp_path / "run" / "slabs").iterdir())
    units = ["block.0", "block.1", "embed", "head"]
    # generation 3; a fused update keeps its one micro-batch's gradient in memory: no gradient file
    grads = [f"{u}.grad" for u in units] if timing == "after-backward" else []
    assert slabs == sorted([f"{u}.3.state" for u in units] + grads)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["units"] == {u: 3 for u in units}
    assert not (tmp_path / "run" / "journal.json").exists()
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        for unit, layout in trainer.layouts.items():
            path = tmp_path / "run" / "slabs" / f"{unit}.3.state"
            chunk_bytes = 4 * 3  # master, exp_avg, exp_avg_sq: a load casts the master, no compute copy
            assert path.stat().st_size == layout.numel * chunk_bytes + TRAILER_BYTES
            trailer = Trailer.read(path, unit)
            assert (trailer.unit, trailer.generation) == (unit, 3)
            assert manifest["checksums"][path.name] == trailer.checksum


def test_ram_tier_is_durable_only_after_save_and_resumes_identically(tmp_path):
    ram = DISK.replace(store="ram")
    data = batches(4)
    with StreamingTrainer(CFG, ram, store_dir=tmp_path / "run") as trainer:
        with pytest.raises(StoreError, match="nothing was committed"):
            HostStore.open(tmp_path / "run")  # never saved (and the lock is checked after the manifest)
        for ids in data[:2]:
            trainer.step(ids)
        trainer.save()
        trainer.step(data[2])  # not saved: lost on a crash, by design
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert trainer.step_count == 2
        for ids in data[2:]:
            trainer.step(ids)
        resumed = trainer.state_dict()
    with StreamingTrainer(CFG, ram, store_dir=tmp_path / "ref") as trainer:
        for ids in data:
            trainer.step(ids)
        assert same(resumed, trainer.state_dict())


def test_a_ram_tier_store_made_without_a_folder_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the store's temporary folder goes
    ram = DISK.replace(store="ram")
    with StreamingTrainer(CFG, ram) as trainer:
        trainer.step(batches(1)[0])
        trainer.save()  # writes its state files into the temporary folder
        assert [p.name for p in tmp_path.iterdir()][0].startswith("ws-store-")
    assert not any(tmp_path.iterdir())  # closed: deleted
    StreamingTrainer(CFG, ram).step(batches(1)[0])  # never closed: deleted once collected
    gc.collect()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("timing", ["fused", "after-backward"])
def test_a_step_drops_the_generation_it_replaces_from_the_page_cache(tmp_path, monkeypatch, timing):
    """A state file's bytes leave the page cache as the next generation's same bytes are written: every byte of
    every replaced generation this process read, and none of the generations the step writes."""
    dropped: dict[str, list[tuple[int, int]]] = {}
    fadvise = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append((offset, length))
        fadvise(fd, offset, length, advice)

    tc = DISK.replace(update_timing=timing)
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(batches(1)[0])
        before = dict(trainer.store.versions)
        monkeypatch.setattr(os, "posix_fadvise", recording)
        trainer.step(batches(2)[1])
        after = dict(trainer.store.versions)
        files = trainer.store._files
        for unit, generation in before.items():
            assert after[unit] != generation
            ranges = sorted(dropped.pop(files.state_path(unit, generation).name))
            covered = 0
            for offset, length in ranges:  # contiguous, in order, from the first byte to the last
                assert offset == covered
                covered += length
            assert covered == files.state_bytes(unit)
    assert not dropped  # nothing else: not the new generations, nor the gradient files


def test_compute_on_disk_with_state_in_ram_is_rejected(tmp_path):
    with pytest.raises(StoreError, match="compute='disk' needs state='disk'"):
        StreamingTrainer(CFG, DISK.replace(store=Placement("disk", "ram", "ram")), store_dir=tmp_path / "run")


# --- writes past the page cache ------------------------------------------------------------------------------

def _no_direct_open(monkeypatch) -> None:
    """A filesystem without O_DIRECT (older tmpfs): opening with the flag is EINVAL."""
    original = os.open

    def refusing(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return original(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)


def _direct_writes_refused(monkeypatch) -> None:
    """O_DIRECT opens, but the device's block is larger than the writes' alignment: each direct write is EINVAL."""
    original = os.pwritev

    def pwritev(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return original(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


def test_state_files_are_the_same_bytes_with_and_without_direct_writes(tmp_path, monkeypatch):
    """Every state file is written past the page cache where the filesystem allows it, else through it; the
    files, their checksums and a reopened run are the same either way. A stage larger than a unit's file
    and one smaller (its writes then cross several stages) both run."""
    tc = DISK.replace(update_chunk=3000)
    trained(tmp_path / "direct", tc)
    with monkeypatch.context() as patch:  # refused when a file's only stage is written, at its finish
        _direct_writes_refused(patch)
        trained(tmp_path / "refused-one-stage", tc)
    monkeypatch.setattr(direct, "STAGE_BYTES", 8 * 4096)
    trained(tmp_path / "small-stage", tc)
    with monkeypatch.context() as patch:
        _no_direct_open(patch)
        trained(tmp_path / "cached", tc)
    with monkeypatch.context() as patch:
        _direct_writes_refused(patch)
        trained(tmp_path / "refused", tc)
    reference = snapshot(tmp_path / "direct")
    for run in ("refused-one-stage", "small-stage", "cached", "refused"):
        assert snapshot(tmp_path / run) == reference, run
        with StreamingTrainer.open(tmp_path / run) as trainer:  # verifies every checksum
            assert trainer.step_count == 2


def _direct_reads_refused(monkeypatch) -> list[str]:
    """O_DIRECT opens, but each direct read is EINVAL (a device block larger than the reads' alignment); the
    names of the files refused."""
    original, refused = os.preadv, []

    def preadv(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return original(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return refused


def _page_aligned(nbytes: int) -> torch.Tensor:
    """Bytes at the start of a fresh mapping, as the buffer cache's and the staging pool's buffers are."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def test_state_files_are_read_past_the_page_cache_where_aligned(tmp_path, monkeypatch):
    """A state file's piece whose buffer and offset are block aligned is read past the page cache (O_DIRECT), its
    unaligned rest through it, with the file's bytes either way. Where the filesystem refuses a direct read, the
    piece is read through the page cache, and so is the rest of that file."""
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(4096))
    fd = direct.open_for_direct_reads(probe)
    if fd is None:
        pytest.skip(f"{tmp_path}'s filesystem has no O_DIRECT")
    os.close(fd)
    trained(tmp_path / "run", DISK.replace(update_chunk=3000))  # pieces of 12000 bytes: 2 blocks and a rest
    reads: list[tuple[bool, int, int]] = []  # (direct, file offset, bytes)
    original = os.preadv

    def recording(fd: int, buffers: Any, offset: int) -> int:
        n = original(fd, buffers, offset)
        reads.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, n))
        return n

    def read_every_piece(files: StateFiles, versions: dict[str, int]) -> int:
        """Read each kind of each chunk of every state file into a page-aligned buffer, and compare it with the
        file's bytes; returns the pieces that start on a block."""
        aligned = 0
        for unit, numel in files.numels.items():
            data = files.state_path(unit, versions[unit]).read_bytes()
            for first in range(0, numel, files.spec.chunk):
                count = files.chunk_count(unit, first)
                for kind in files.spec.file_kinds():
                    offset, nbytes = files.spec.kind_offset(kind, first, count), files.spec.kind_bytes(kind, count)
                    out = _page_aligned(nbytes)
                    files.read(unit, versions[unit], kind, first, out.view(files.spec.kind_dtype(kind)))
                    assert bytes(out.numpy()) == data[offset:offset + nbytes]
                    aligned += offset % 4096 == 0
        return aligned

    with StreamingTrainer.open(tmp_path / "run") as trainer, monkeypatch.context() as patch:
        patch.setattr(os, "preadv", recording)
        aligned = read_every_piece(trainer.store._files, trainer.store.versions)
    direct_reads = [(offset, n) for through, offset, n in reads if through]
    assert aligned and len(direct_reads) == aligned
    assert all(offset % 4096 == 0 and n % 4096 == 0 and n > 0 for offset, n in direct_reads)
    assert sum(n for *_, n in reads) == sum(len(p.read_bytes()) - TRAILER_BYTES
                                             for p in (tmp_path / "run" / "slabs").glob("*.state"))
    with StreamingTrainer.open(tmp_path / "run") as trainer, monkeypatch.context() as patch:
        refused = _direct_reads_refused(patch)
        read_every_piece(trainer.store._files, trainer.store.versions)
    assert sorted(refused) == sorted(p.name for p in (tmp_path / "run" / "slabs").glob("*.state"))  # once each


# --- commits without a journal ------------------------------------------------------------------------------

def test_failed_weight_load_keeps_the_committed_step(tmp_path, monkeypatch):
    """Loading weights rewrites every unit at the same step: the old generation stays until the manifest moves."""
    before = trained(tmp_path / "run")
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        other = {k: v + 1 for k, v in before.items()}
        with monkeypatch.context() as patch:
            # the embedding's file written (its staged data, tail and trailer) and renamed, then the disk is full
            fail_writes_after(patch, 3)
            with pytest.raises(StoreError, match="disk full"):
                trainer.load_state_dict(other)
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert trainer.step_count == 2 and same(trainer.state_dict(), before)
        trainer.load_state_dict(other)  # with space, the load commits
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert same(trainer.state_dict(), other)


def test_failed_ram_tier_save_keeps_the_previous_save(tmp_path, monkeypatch):
    ram = DISK.replace(store="ram")
    data = batches(3)
    with StreamingTrainer(CFG, ram, store_dir=tmp_path / "run") as trainer:
        trainer.step(data[0])
        trainer.save()
        saved = trainer.state_dict()
        trainer.step(data[1])
        with monkeypatch.context() as patch:
            fail_writes_after(patch, 6)
            with pytest.raises(StoreError, match="disk full"):
                trainer.save()
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert trainer.step_count == 1 and same(trainer.state_dict(), saved)
    assert not list((tmp_path / "run" / "slabs").glob("*.tmp"))


# --- integrity -------------------------------------------------------------------------------------------------

def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _damage(kind: str, slabs: Path) -> Path:
    state = slabs / "block.1.3.state"
    if kind == "flipped byte":
        _flip_byte(state, 1000)
    elif kind == "flipped trailer checksum":
        _flip_byte(state, state.stat().st_size - 8)
    elif kind == "truncated":
        os.truncate(state, state.stat().st_size - 100)
    elif kind == "zeroed trailer":
        with open(state, "r+b") as f:
            f.seek(-TRAILER_BYTES, os.SEEK_END)
            f.write(bytes(TRAILER_BYTES))
    elif kind == "missing":
        state.unlink()
    elif kind == "another unit's file":
        shutil.copy(slabs / "block.0.3.state", state)
    return state


@pytest.mark.parametrize("kind,match", [
    ("flipped byte", "checksum mismatch"), ("flipped trailer checksum", "checksum mismatch"),
    ("truncated", "bytes, expected .*truncated"), ("zeroed trailer", "no slab trailer"),
    ("missing", "missing"), ("another unit's file", "holds unit 'block.0'")])
def test_damaged_state_file_is_named_and_nothing_is_touched(tmp_path, kind, match):
    trained(tmp_path / "run")
    path = _damage(kind, tmp_path / "run" / "slabs")
    before = snapshot(tmp_path / "run")
    with pytest.raises(StoreError, match=match) as error:
        StreamingTrainer.open(tmp_path / "run")
    assert "unit block.1" in str(error.value) and str(path) in str(error.value)
    assert snapshot(tmp_path / "run") == before


def test_verify_false_skips_the_checksum_but_not_the_size_checks(tmp_path):
    trained(tmp_path / "run")
    _damage("flipped byte", tmp_path / "run" / "slabs")
    HostStore.open(tmp_path / "run", verify=False).close()
    _damage("truncated", tmp_path / "run" / "slabs")
    with pytest.raises(StoreError, match="unit block.1"):
        HostStore.open(tmp_path / "run", verify=False)


def _journaled_crash(root: Path, monkeypatch) -> None:
    """Two steps, then a third whose update stops (disk full) after the journal: a roll-forward is pending."""
    data = batches(3)
    with StreamingTrainer(CFG, JOURNALED, store_dir=root) as trainer:
        for ids in data[:2]:
            trainer.step(ids)
        with monkeypatch.context() as patch:
            fail_writes_after(patch, 4 + 4)  # the gradients, then a unit (<= 3 writes: staged, tail, trailer) and a bit
            with pytest.raises(StoreError, match="disk full"):
                trainer.step(data[2])
    assert (root / "journal.json").exists()


def test_corrupted_gradient_blocks_the_roll_forward(tmp_path, monkeypatch):
    _journaled_crash(tmp_path / "run", monkeypatch)
    _flip_byte(tmp_path / "run" / "slabs" / "head.grad", 20)
    before = snapshot(tmp_path / "run")
    with pytest.raises(StoreError, match=r"unit head: checksum mismatch in .*head\.grad"):
        StreamingTrainer.open(tmp_path / "run")
    assert snapshot(tmp_path / "run") == before


def unsealed(path: Path) -> dict:
    """A record's fields without its checksum: as a store written before records had one holds them."""
    record = json.loads(path.read_text())
    del record["checksum"]
    return record


@pytest.mark.parametrize("edit,match", [
    (lambda j: {**j, "step": j["step"] + 1}, "does not follow"),
    (lambda j: {k: v for k, v in j.items() if k != "grad_checksums"}, "grad_checksums"),
    (lambda j: "not json{", "cannot be read"),
])
def test_damaged_journal_is_an_error(tmp_path, monkeypatch, edit, match):
    _journaled_crash(tmp_path / "run", monkeypatch)
    path = tmp_path / "run" / "journal.json"
    changed = edit(unsealed(path))  # the checks of a record without a checksum (a store written before them)
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with pytest.raises(StoreError, match=match) as error:
        StreamingTrainer.open(tmp_path / "run")
    assert "journal.json" in str(error.value)


def test_stale_journal_is_ignored_and_removed(tmp_path):
    """The manifest was written but the journal's removal did not reach the disk (power loss)."""
    data = batches(3)
    with StreamingTrainer(CFG, JOURNALED, store_dir=tmp_path / "run") as trainer:
        trainer.step(data[0])
        original = trainer.store.finish_step
        kept = {}

        def keep_journal(step: int, state: dict) -> None:
            kept["journal"] = (tmp_path / "run" / "journal.json").read_text()
            original(step, state)

        trainer.store.finish_step = keep_journal
        trainer.step(data[1])
        weights = trainer.state_dict()
    (tmp_path / "run" / "journal.json").write_text(kept["journal"])
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert trainer.step_count == 2 and same(trainer.state_dict(), weights)
    assert not (tmp_path / "run" / "journal.json").exists()


def test_not_a_store_and_an_unfinished_first_commit(tmp_path):
    with pytest.raises(StoreError, match="not a weight-streaming store"):
        HostStore.open(tmp_path)
    (tmp_path / "slabs").mkdir()
    with pytest.raises(StoreError, match="nothing was committed.*delete the folder"):
        HostStore.open(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not empty"):
        HostStore.create(tmp_path, StoreSpec(CFG))


# --- lock and disk cost ---------------------------------------------------------------------------------------

def test_one_process_at_a_time(tmp_path):
    trained(tmp_path / "run")
    store = HostStore.open(tmp_path / "run")
    with pytest.raises(StoreError, match="in use by another"):
        HostStore.open(tmp_path / "run")
    store.close()
    HostStore.open(tmp_path / "run").close()


def test_readers_share_the_lock_write_nothing_and_refuse_to_write(tmp_path, monkeypatch):
    weights = trained(tmp_path / "run")
    (tmp_path / "run" / "lock").unlink()  # an archive without it: a reader creates it only where it can
    before = snapshot(tmp_path / "run")
    with StreamingTrainer.open(tmp_path / "run", read_only=True) as a, \
            StreamingTrainer.open(tmp_path / "run", read_only=True) as b:  # readers together
        assert same(a.state_dict(), weights) and same(b.state_dict(), weights)
        with pytest.raises(StoreError, match="in use by another"):
            HostStore.open(tmp_path / "run")  # a writer waits for the readers
        with pytest.raises(StoreError, match="opened for reading"):
            a.step(batches(1)[0])
        with pytest.raises(StoreError, match="opened for reading"):
            a.save()
    assert snapshot(tmp_path / "run") == {**before, "lock": b""}
    writer = HostStore.open(tmp_path / "run")
    with pytest.raises(StoreError, match="being trained by another process"):
        HostReader.open(tmp_path / "run")  # and readers for the writer
    writer.close()
    _journaled_crash(tmp_path / "crashed", monkeypatch)
    before = snapshot(tmp_path / "crashed")
    with pytest.raises(StoreError, match="step 3 was interrupted.*streamer train --resume"):
        StreamingTrainer.open(tmp_path / "crashed", read_only=True)  # finishing it would write
    assert snapshot(tmp_path / "crashed") == before


def _noting_fds(flushes: list[int], flush):
    """os.fsync or os.fdatasync, noting each descriptor flushed."""
    return lambda fd: flushes.append(fd) or flush(fd)


@pytest.mark.parametrize("tc", [DISK, JOURNALED], ids=["fused", "journaled"])
def test_a_step_flushes_what_the_planner_prices(tmp_path, monkeypatch, tc):
    """The flushes (fsync, fdatasync) of a disk-tier step are the ones the planner counts: SEAL_FLUSHES per
    unit's state file and the commit's own (timing.commit_flushes)."""
    from memory_model import PlanConfig
    from memory_model.timing import SEAL_FLUSHES, commit_flushes

    data = batches(3)
    with StreamingTrainer(CFG, tc.replace(max_grad_norm=0), store_dir=tmp_path / "run") as trainer:
        trainer.step(data[0])  # unclipped: a fused step is not undone and made again
        flushes = []
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, _noting_fds(flushes, getattr(os, name)))
        trainer.step(data[1])
        assert trainer.fused == (tc is DISK)
    planned = PlanConfig.of(batch=2, seq=32, store="disk", update_timing=tc.step.update_timing,
                            update_chunk=tc.step.update_chunk)
    assert len(flushes) == SEAL_FLUSHES * len(CFG.unit_names()) + commit_flushes(CFG, planned)


def test_disk_holds_one_state_plus_gradients_plus_one_unit(tmp_path, monkeypatch):
    """docs/STORE.md's disk cost, measured at every rename and fsync of two steps."""
    data = batches(3)
    with StreamingTrainer(CFG, DISK, store_dir=tmp_path / "run") as trainer:
        trainer.step(data[0])
        slabs = tmp_path / "run" / "slabs"
        state = {p.name: p.stat().st_size for p in slabs.glob("*.state")}
        grads = sum(p.stat().st_size for p in slabs.glob("*.grad"))
        peak = [0]

        def measure(original: Any) -> Any:
            def wrapper(*args: Any) -> Any:
                result = original(*args)
                peak[0] = max(peak[0], sum(p.stat().st_size for p in slabs.iterdir()))
                return result
            return wrapper

        monkeypatch.setattr(os, "replace", measure(os.replace))
        monkeypatch.setattr(os, "fsync", measure(os.fsync))
        for ids in data[1:]:
            trainer.step(ids)
    assert peak[0] <= sum(state.values()) + grads + max(state.values())
    assert peak[0] > sum(state.values()) + grads  # the one transient copy is there


def test_a_commit_deletes_the_replaced_generation_while_the_next_step_runs(tmp_path, monkeypatch):
    """The trainer does not wait for a commit's unlinks (slow for large files); the next generation's first
    file does, so the disk never holds a third generation of a unit, and nothing is left once closed."""
    returned, unlinks = [threading.Event() for _ in range(3)], []  # one per step

    def unlink_after_the_step_returned(paths: list[Path]) -> None:
        # The n-th commit's unlinks wait for its step to return: a trainer waiting for them times out here.
        unlinks.append(returned[len(unlinks)].wait(timeout=30))
        for path in paths:
            path.unlink()

    opened = direct.SequentialFile.__init__
    generations_at_new_file = []

    def counting(self: Any, path: Path, pool: Any) -> None:
        unit = path.name.split(".state")[0].rsplit(".", 1)[0]
        generations_at_new_file.append(len(list(path.parent.glob(f"{unit}.*.state*"))) + 1)
        opened(self, path, pool)

    monkeypatch.setattr(StateFiles, "_delete_all", staticmethod(unlink_after_the_step_returned))
    monkeypatch.setattr(direct.SequentialFile, "__init__", counting)
    fused = DISK.replace(update_timing="fused", max_grad_norm=0)
    with StreamingTrainer(CFG, fused, store_dir=tmp_path / "run") as trainer:
        for ids, step_returned in zip(batches(3), returned, strict=True):
            trainer.step(ids)
            step_returned.set()
    assert unlinks == [True, True, True]
    assert max(generations_at_new_file) == 2
    units = ["block.0", "block.1", "embed", "head"]
    assert sorted(p.name for p in (tmp_path / "run" / "slabs").iterdir()) == sorted(f"{u}.4.state" for u in units)


def test_missing_gradient_blocks_the_roll_forward_even_without_verify(tmp_path, monkeypatch):
    _journaled_crash(tmp_path / "run", monkeypatch)
    (tmp_path / "run" / "slabs" / "head.grad").unlink()
    with pytest.raises(StoreError, match=r"unit head: gradient file \(needed to finish step 3\) .* is missing"):
        HostStore.open(tmp_path / "run", verify=False)


def test_open_removes_debris_of_its_own_and_nothing_else(tmp_path):
    trained(tmp_path / "run")
    slabs = tmp_path / "run" / "slabs"
    (slabs / "block.0.7.state.tmp").write_bytes(b"torn")  # a crash's leftovers
    (slabs / "head.2.state").write_bytes(b"old generation")
    (slabs / "notes.txt").write_text("the user's")
    (slabs / "other.1.state").write_text("not a unit of this model")
    HostStore.open(tmp_path / "run").close()
    assert sorted(p.name for p in slabs.iterdir() if not p.name.endswith((".3.state", ".grad"))) == [
        "notes.txt", "other.1.state"]


def test_a_store_of_the_crc32_format_is_refused_with_the_way_out_and_left_untouched(tmp_path):
    trained(tmp_path / "run")
    manifest_path = tmp_path / "run" / "manifest.json"
    manifest = unsealed(manifest_path)
    manifest_path.write_text(json.dumps({**manifest, "format": "weight-streaming-store/2"}))
    before = snapshot(tmp_path / "run")
    with pytest.raises(StoreError, match="earlier weight-streaming .*export it to a Hugging Face checkpoint"):
        StreamingTrainer.open(tmp_path / "run")
    assert snapshot(tmp_path / "run") == before


@pytest.mark.parametrize("tc,refused", [(DISK, True), (DISK.replace(store="ram"), False),
                                         (DISK.replace(dtype="fp32"), False)])
def test_a_store_of_format_3_opens_unless_its_state_files_hold_a_compute_copy(tmp_path, tc, refused):
    """Format 3's disk tier kept a bf16 copy in its state files: that is refused, untouched; its stores without
    one have format 4's files and open as they are."""
    weights = trained(tmp_path / "run", tc)
    manifest_path = tmp_path / "run" / "manifest.json"
    manifest = unsealed(manifest_path)
    manifest_path.write_text(json.dumps({**manifest, "format": "weight-streaming-store/3"}))
    before = snapshot(tmp_path / "run")
    if refused:
        with pytest.raises(StoreError, match="kept a compute copy .*export it to a Hugging Face checkpoint"):
            StreamingTrainer.open(tmp_path / "run")
        assert snapshot(tmp_path / "run") == before
        return
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert all(torch.equal(weights[k], v) for k, v in trainer.state_dict().items())


def test_a_state_file_with_a_crc32_trailer_is_named(tmp_path):
    trained(tmp_path / "run")
    state = tmp_path / "run" / "slabs" / "block.1.3.state"
    with open(state, "r+b") as f:
        f.seek(-TRAILER_BYTES, os.SEEK_END)
        f.write(b"WSSLAB01")
    with pytest.raises(StoreError, match="unit block.1: .*earlier weight-streaming \\(crc32"):
        StreamingTrainer.open(tmp_path / "run")


def test_the_runtime_uses_the_store_only_through_its_interface():
    """Every attribute the runtime (transport, executor, passes, update) and the trainer (and its weights in and
    out) take from a store (or a writer it gave) is one the interface declares, and the transport, which only
    reads, takes only the reader's: a back end can change without the runtime knowing, and a store opened for
    reading serves every read."""
    import ast
    import inspect

    from streamer.store.interface import StateWriter, StoreReader, StoreWriter
    from streamer.store.shards import MergedShards

    def members(*classes: type) -> set[str]:
        return {name for cls in classes for name in (*vars(cls), *cls.__annotations__)}

    reads = members(StoreReader)
    declared = members(StoreReader, StoreWriter, StateWriter)
    used: dict[str, set[str]] = {}
    root = Path(__file__).resolve().parents[1]
    for path in ("streamer/runtime/transport.py", "streamer/runtime/executor.py", "streamer/runtime/passes.py",
                 "streamer/runtime/update.py", "streamer/trainer.py", "streamer/weights.py"):
        for node in ast.walk(ast.parse((root / path).read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value  # `store.x`, `self.store.x`, `writer.x` or `self._writers[unit].x`
            if isinstance(owner, ast.Subscript):
                name = "writer" if getattr(owner.value, "attr", None) == "_writers" else None
            elif isinstance(owner, ast.Attribute):
                name = owner.attr if getattr(owner.value, "id", None) == "self" else None
            else:
                name = getattr(owner, "id", None)
            if name in ("store", "_store", "writer"):
                used.setdefault(node.attr, set()).add(path)
    assert used, "the scan found no store calls: it no longer matches the code"
    assert {name: paths for name, paths in used.items() if name not in declared} == {}
    assert {name for name, paths in used.items() if "streamer/runtime/transport.py" in paths} <= reads
    assert not any(name.startswith("_") for name in declared - {"__enter__", "__exit__"} if name in used)
    assert all(map(inspect.isabstract, (StoreReader, StoreWriter, StateWriter)))
    # The readers are readers only: each implements every read and has no write to refuse.
    for reader in (HostReader, MergedShards):
        assert not inspect.isabstract(reader) and not issubclass(reader, StoreWriter)
        assert not members(reader) & (members(StoreWriter) - reads)


def test_the_torch_dtypes_are_the_sized_dtypes() -> None:
    # memory_model sizes dtypes without torch; the store's torch dtypes must be the same names and sizes.
    from memory_model import DTYPE_BYTES
    from streamer.store.layout import DTYPES
    assert {name: dtype.itemsize for name, dtype in DTYPES.items()} == {n: DTYPE_BYTES[n] for n in DTYPES}
    # int8 is a stored form only (block-quantized moments): the store keeps its bytes, one per element.
    assert set(DTYPE_BYTES) - set(DTYPES) == {"int8"}
    int8 = StoreSpec(GPTJConfig.preset("gptj-debug"), Precision("bf16", moments="int8"), chunk=256)
    assert int8.kind_dtype("exp_avg").itemsize == DTYPE_BYTES["int8"]
