"""Moving slabs between the host store and the device, on the executor's I/O threads.

Three cases, one interface:
- `shared`: the device is the CPU, the host's own memory. A RAM-tier slab is handed over as it is (a copy
  would change nothing); a disk-tier slab is read straight into a reused buffer.
- `cuda`: bytes cross on a side stream with non-blocking copies, and the compute stream waits on an event
  before it touches them. They cross from and to staging buffers of a bounded pool (`StagingPool`), pinned
  unless the store's `pin_memory` is "none": disk slabs are read into one, a RAM slab is copied into one
  (pin_memory "staging", on several threads: `HostCopier`) or crosses straight from the slab (`crosses_directly`:
  pinned with "all" or "register"; pageable with "none", which the CUDA driver then stages itself). Offloaded
  block inputs go to pinned buffers of their own pool and back.
- `meta`: shapes only, for the dry run (the real schedule and ledger, no memory, no I/O).
The ledger is charged by the executor, not here, so its accounting does not depend on thread timing.

Long because the three cases share one interface and its host buffers' pools (`StagingPool`, `BufferPool`): split
by case, each would carry its own copy of the pooling that keeps the host to the plan.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Protocol, Sequence, TypeVar

import torch

from memory_model import Ledger
from streamer.store.interface import StoreReader
from streamer.store.layout import fold_into
from streamer.store.spec import STATE_KINDS

T = TypeVar("T")

# The host's work as named in a torch.profiler trace (record_function ranges), which gpu-check's breakdown of a
# step's time reads: staging copies, the gradient fold, AdamW on the host and the update's write-backs.
HOST_COPY, GRADIENT_FOLD, HOST_UPDATE, WRITE_BACK = "ws: host copy", "ws: gradient fold", "ws: host update", \
    "ws: write-back"


class IOWorker:
    """One background thread (or none: jobs run at once); jobs run in submission order, so the write-backs
    on one worker write a unit's state file sequentially."""

    def __init__(self, threaded: bool) -> None:
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="stream-io") if threaded else None

    def submit(self, job: Callable[[], T]) -> "cf.Future[T]":
        if self._pool is not None:
            return self._pool.submit(job)
        future: cf.Future[T] = cf.Future()
        try:
            future.set_result(job())
        except BaseException as exc:  # re-raised by .result(), where the caller waits
            future.set_exception(exc)
        return future

    def drain(self) -> None:
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class HostCopier:
    """Host-to-host copies of flat tensors (a pageable RAM slab into a pinned staging buffer) split into
    `threads` contiguous pieces, copied at once: the calling thread takes the first, a small pool the rest. torch
    releases the GIL inside copy_, so the pieces run in parallel; each piece's copy_ may use torch's intra-op
    threads too. Below `MIN_SPLIT_BYTES` a copy is not split: the threads' hand-off would cost more."""

    MIN_SPLIT_BYTES = 4 * 2**20

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a host copy needs at least one thread, got {threads}")
        self.threads = threads
        self._pool = cf.ThreadPoolExecutor(threads - 1, thread_name_prefix="host-copy") if threads > 1 else None

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """`dst.copy_(src)` for flat tensors of one length (dtypes may differ); returns `dst`."""
        n = dst.numel()
        if src.numel() != n:
            raise ValueError(f"a host copy of {src.numel()} elements into {n}")
        with torch.profiler.record_function(HOST_COPY):
            if self._pool is None or n * max(dst.element_size(), src.element_size()) < self.MIN_SPLIT_BYTES:
                return dst.copy_(src)
            bounds = split_evenly(n, self.threads)
            rest = [self._pool.submit(dst[lo:hi].copy_, src[lo:hi]) for lo, hi in bounds[1:]]
            lo, hi = bounds[0]
            dst[lo:hi].copy_(src[lo:hi])
            for future in rest:
                future.result()
        return dst

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def staging_threads(cores: int | None = None) -> int:
    """Threads a staging copy is split over: one per four of the host's cores, at most four (16 cores: 4), so
    that the copies, the gradient fold and a host update each keep cores of their own; one on a small host."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return max(1, min(4, cores // 4))


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of `parts` contiguous pieces of n elements, their lengths differing by one at most, each
    a multiple of 64 elements but the last (cache lines are not shared between two threads' writes)."""
    step = -(-n // parts)
    step = -(-step // 64) * 64
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


class IOQueues:
    """The executor's I/O threads. Loads go to `reads`; gradient offloads and update write-backs to `writes`,
    so a unit's state file is written in order while the next unit's reads proceed (an update reads a
    gradient only once every offload has been waited for, at the end of the backward, and the offloads of
    one unit's micro-batches are ordered on their one queue). `folds` is where a gradient is folded into the
    host accumulator: `writes`, or inline (`inline_fold`) where the device is the host's own cores and the
    accumulator is in RAM, since on a thread of its own the fold oversubscribes the cores the compute uses
    (each thread brings its own OpenMP team; measured faster inline on gptj-350m, BENCHMARKS.md)."""

    def __init__(self, threaded: bool, inline_fold: bool) -> None:
        self.reads, self.writes = IOWorker(threaded), IOWorker(threaded)
        self.folds = IOWorker(threaded=False) if inline_fold else self.writes

    def drain(self) -> None:
        self.reads.drain()
        self.writes.drain()

    def close(self) -> None:
        self.reads.close()
        self.writes.close()


@dataclass
class Loaded:
    """Device tensors of one resource, and the event the compute stream must wait on (CUDA)."""

    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None

    def wait(self) -> dict[str, torch.Tensor]:
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        return self.tensors


class StagingPool:
    """Host buffers copies to and from the device go through, reused by size, at most `limit` bytes pooled.

    A buffer asked for once the pool holds `limit` bytes is plain pageable memory, handed out once and dropped
    when given back: a copy through it is slower (the driver stages it), never wrong. So pinned memory stays
    within `limit`, whatever the schedule asks for (StoreSpec.staging_bytes sizes it for what a step holds).
    """

    def __init__(self, limit: int, pin: bool) -> None:
        self.limit, self.pin = limit, pin
        self.pooled_bytes = 0  # every pooled buffer's bytes, free or handed out
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._pooled: set[int] = set()  # data_ptr of every pooled buffer
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * dtype.itemsize
        with self._lock:
            free = self._free.get((numel, dtype))
            buffer, read = free.pop() if free else (None, None)
            if buffer is None and self.pooled_bytes + size > self.limit:
                return torch.empty(numel, dtype=dtype)
            if buffer is None:
                self.pooled_bytes += size
                buffer = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
                self._pooled.add(buffer.data_ptr())
        if read is not None:
            read.synchronize()  # the copy to the device that reads it has finished: it may be written again
        return buffer

    def give_back(self, t: torch.Tensor, read: torch.cuda.Event | None = None) -> None:
        """Return a buffer `take` gave out; `read`: the event after which a copy in flight has read it."""
        with self._lock:
            if t.data_ptr() in self._pooled:
                self._free.setdefault((t.numel(), t.dtype), []).append((t, read))


class BufferPool:
    """Flat host buffers reused across sizes: a request takes the smallest free buffer that holds it (at most
    twice its size, so a unit's last, shorter chunk and a tied head's weights reuse what the others held), viewed
    as the dtype asked for.

    Where the device is the host's own memory, these buffers are the device's bytes: the ledger charges them
    while they are handed out, and a free one is kept only while the free ones and what the ledger holds stay
    within the most it has held (`in_use`, read after each charge: `trim`). So the pool never holds more than
    the device's peak, whatever sizes a step asks for and however many steps run; a buffer given back beyond
    that is dropped (a large one is unmapped at once). A load's own charge, made before it runs, pushes out no
    free buffer (`charging_loads`): its buffer comes from here. A unit's weight gradient, which autograd makes
    before the ledger is handed it, is counted while its backward runs (`reserving`). Without `in_use` every free
    buffer is kept."""

    GRANULE = 2**21  # capacities rounded up to it: sizes a few elements apart share buffers

    def __init__(self, in_use: Callable[[], int] | None = None) -> None:
        self._in_use, self._ceiling = in_use, 0
        self._reserved = 0  # bytes about to be allocated outside the pool and the ledger (`reserving`)
        self._free: list[torch.Tensor] = []  # uint8 buffers
        self._lock = threading.Lock()
        self._charging_loads = threading.local()  # set on a thread while it charges loads (`charging_loads`)

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * max(nbytes, self.GRANULE)]
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
            if buffer is None:
                self._trim()
        if buffer is None:
            buffer = torch.empty(-(-nbytes // self.GRANULE) * self.GRANULE if nbytes > self.GRANULE else nbytes,
                                 dtype=torch.uint8)
        return buffer[:nbytes].view(dtype)

    def give_back(self, t: torch.Tensor) -> None:
        """Return a buffer `take` gave out: the whole of its storage is free again. A buffer never given back is
        freed as any tensor is, when its last reference goes."""
        if t.storage_offset() != 0:
            return  # a piece of a larger tensor is not the caller's to give
        buffer = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        with self._lock:
            self._free.append(buffer)
            self._trim()

    def trim(self) -> None:
        """Drop free buffers, largest first, until the free ones and the device's bytes in use are within the
        most it has held: called as the ledger changes, so bytes autograd allocates push out idle buffers. Not
        for the charges of loads (`charging_loads`)."""
        if getattr(self._charging_loads, "on", False):
            return
        with self._lock:
            self._trim()

    @contextlib.contextmanager
    def charging_loads(self) -> Iterator[None]:
        """While this thread charges the loads it is about to issue. Their bytes are not allocated yet: their
        buffers come from this pool when the loads run, and a free buffer kept for them is the memory those
        charges stand for, so they push none out. A load that finds none fitting trims the pool first (`take`)."""
        self._charging_loads.on = True
        try:
            yield
        finally:
            self._charging_loads.on = False

    @contextlib.contextmanager
    def reserving(self, nbytes: int) -> Iterator[None]:
        """While the context lasts, `nbytes` the device will hold before the ledger charges them count as in use:
        free buffers make room for them first, so the device's bytes stay within the most the ledger has held."""
        with self._lock:
            self._reserved += nbytes
            self._trim()
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= nbytes

    def _trim(self) -> None:
        if self._in_use is None:
            return
        in_use = self._in_use()
        self._ceiling = max(self._ceiling, in_use)
        in_use += self._reserved
        free = self.free_bytes
        self._free.sort(key=torch.Tensor.numel)
        while self._free and free + in_use > self._ceiling:
            free -= self._free.pop().numel()


def crosses_directly(pin_memory: str) -> bool:
    """Whether a RAM slab crosses to a CUDA device as it lies, with no staging copy on the host: pinned ("all"),
    registered where it lies ("register"), or pageable where nothing is pinned ("none": the driver stages it)."""
    return pin_memory != "staging"


def _fill_or_copy(out: torch.Tensor, fill: Callable[[torch.Tensor], object] | None, ram: torch.Tensor | None,
                  copy: Callable[[torch.Tensor], object]) -> None:
    """`out` copied from the RAM slab `ram` (by `copy`), else filled by `fill`."""
    if ram is not None:
        copy(ram)
    else:
        assert fill is not None, "a load from neither a RAM slab nor a fill"
        fill(out)


class Wiring(Protocol):
    """What a `Transport` reads of the runtime's wiring (`streamer.runtime.wiring.Runtime`, which builds it)."""

    @property
    def store(self) -> StoreReader | None: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def weights_dtype(self) -> torch.dtype: ...
    @property
    def ledger(self) -> Ledger: ...


class Transport:
    def __init__(self, rt: Wiring) -> None:
        self.store, self.device, self.compute_dtype = store, device, compute_dtype = rt.store, rt.device, rt.dtype
        self.mode = {"cpu": "shared", "cuda": "cuda", "meta": "meta"}[device.type]
        self.side_stream = torch.cuda.Stream(device) if self.mode == "cuda" else None
        self.staging = None if store is None or self.mode != "cuda" else \
            StagingPool(store.spec.staging_bytes(), pin=store.pin_memory != "none")
        # Offloaded block inputs (one micro-batch's of every block at most), reused by size from step to step.
        self.stashes = None if self.mode != "cuda" else \
            StagingPool(sys.maxsize, pin=store is None or store.pin_memory != "none")
        self.compute_stream = torch.cuda.current_stream(device) if self.mode == "cuda" else None
        # A RAM slab's copy into a staging buffer, spread over the host's cores (only a CUDA device stages).
        self.copier = HostCopier(staging_threads() if self.mode == "cuda" else 1)
        # Block inputs go out on a stream of their own: behind the loads on the side stream, d2h would wait for h2d.
        self.stash_stream = torch.cuda.Stream(device) if self.mode == "cuda" else None
        # Compute is master (`Precision.compute_is_master`) in bf16: a load reads it straight into the weights. In fp32
        # the fp32 path reads it uncast, into the buffer a fused update keeps as its master (on a cpu, the weights). A
        # frozen base on disk (4-bit bytes, `weights_dtype` uint8, or 16-bit weights) is read as its files hold it.
        self.weights_dtype = rt.weights_dtype
        self.master_is_weights = rt.weights_dtype != compute_dtype or (store is not None and (
            store.spec.frozen or store.spec.compute_is_master and compute_dtype != torch.float32))
        # Host buffers: the device's own where it is the host (cpu), else those a copy to the device goes through
        # when the store has no staging pool.
        self.buffers = BufferPool((lambda: rt.ledger.in_use) if self.mode == "shared" else None)

    def close(self) -> None:
        self.copier.close()

    # --- buffers ------------------------------------------------------------------------------
    def _take(self, numel: int, dtype: torch.dtype, where: str) -> torch.Tensor:
        """A reusable buffer: fresh host allocations page-fault at a quarter of the speed of reused memory.

        `where`: "device", or "pinned" for a host buffer an accelerator copies from. Where the device is the
        host (cpu), both are the same plain memory and share one pool. A CUDA device buffer comes from torch's
        caching allocator, which reuses freed blocks already: pooled here too, idle buffers would hold device
        memory the ledger has released.
        """
        if self.mode == "shared":
            where = "device"
        if self.mode == "cuda" and where == "device":
            return torch.empty(numel, dtype=dtype, device=self.device)
        if self.staging is not None and where == "pinned":
            return self.staging.take(numel, dtype)
        return self.buffers.take(numel, dtype)

    def device_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable device buffer (a unit's all-gathered weights, say); `give_back` it when done."""
        return self._take(numel, dtype, "device")

    def give_back(self, t: torch.Tensor) -> None:
        """Return a buffer `_take` gave out to the pool of its kind (told apart by the tensor's own device)."""
        if self.mode == "meta":
            return
        where = "pinned" if self.mode == "cuda" and t.device.type == "cpu" else "device"
        if where == "pinned" and self.staging is not None:
            self.staging.give_back(t)
            return
        if self.mode == "cuda" and where == "device":
            # Made on the side stream, maybe used on this one: its block is reused once this stream is past here.
            t.record_stream(torch.cuda.current_stream())
            return
        self.buffers.give_back(t)

    def owns(self, t: torch.Tensor, unit: str, kind: str) -> bool:
        """False when `t` is the store's own RAM slab (handed over zero-copy), which must not be pooled."""
        ram = self.store.slab(unit, kind) if self.store is not None else None
        return ram is None or t.untyped_storage().data_ptr() != ram.untyped_storage().data_ptr()

    # --- host -> device -----------------------------------------------------------------------------
    def _to_device(self, fill: Callable[[torch.Tensor], object] | None, ram: torch.Tensor | None,
                   numel: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Device tensor of `numel` elements filled by `fill(host_tensor)` or copied from the RAM slab `ram`;
        `out`: the device tensor to fill (a piece of a larger one), else one of its own."""
        if self.mode == "meta":
            return torch.empty(numel, dtype=dtype, device="meta") if out is None else out
        if self.mode == "shared":
            if ram is not None and ram.dtype == dtype and out is None:
                return ram
            out = self._take(numel, dtype, "device") if out is None else out
            _fill_or_copy(out, fill, ram, out.copy_)
            return out
        direct = ram is not None and crosses_directly(self.held_store.pin_memory)
        host = ram if ram is not None and direct else self._take(numel, dtype, "pinned")
        if not direct:
            _fill_or_copy(host, fill, ram, lambda src: self.copier.copy_(host, src))
        out = self._take(numel, dtype, "device") if out is None else out
        out.copy_(host, non_blocking=True)  # runs on the side stream set by the caller
        if not direct and self.staging is not None:
            # Pooled again at once: the next slab fills another buffer while this one crosses, and whoever
            # takes this one waits for its copy first.
            read = torch.cuda.Event()
            read.record()
            self.staging.give_back(host, read)
        elif not direct:
            torch.cuda.current_stream().synchronize()  # the buffer is reused next
        return out

    @property
    def held_store(self) -> StoreReader:
        """The store; only a dry run's transport (the meta device) reads none."""
        assert self.store is not None, "a dry run reads no store"
        return self.store

    def _on_side_stream(self, job: Callable[[], dict[str, torch.Tensor]]) -> Loaded:
        if self.side_stream is None:
            return Loaded(job())
        with torch.cuda.stream(self.side_stream):
            tensors = job()
            ready = torch.cuda.Event()
            ready.record(self.side_stream)
        return Loaded(tensors, ready)

    def load_weights(self, unit: str, numel: int, from_master: bool, keep_master: bool = False,
                     borrowed: Sequence[tuple[str, int]] = ()) -> Loaded:
        """A unit's compute weights on the device: the store's compute copy (RAM), or (`from_master`) its
        master read and cast on the host (read as it is where stored in the compute dtype; a store chunk at a time
        where the master is not kept), so only compute-dtype bytes cross the link and the ledger's charge is the
        cast weights. `keep_master`: the host fp32 master comes back too ("master"), for the unit's fused update,
        which updates it in place (`host_chunk`); `give_back` it once written. `borrowed`: other units' whole
        weights (unit, numel) the unit uses, laid before its own in one device buffer."""
        store = self.store

        def weights_of(name: str, count: int, keep: bool, out: torch.Tensor | None) -> dict[str, torch.Tensor]:
            if not from_master:
                ram = store.slab(name, "compute") if store is not None else None
                return {"weights": self._to_device(None, ram, count, self.weights_dtype, out)}
            if self.master_is_weights:
                return master_as_weights(name, count, keep, out)
            if not keep:  # cast as it is read, a store chunk at a time: no fp32 copy of the whole unit
                return {"weights": self._to_device(partial(self._read_master, name, 0), None, count,
                                                   self.compute_dtype, out)}
            if self.mode == "meta":
                master = torch.empty(count, dtype=torch.float32, device="meta")
            else:
                master = self._take(count, torch.float32, "pinned")
                self.held_store.read_master(name, master)
            if self.mode == "shared" and self.compute_dtype == torch.float32 and out is None:
                weights = master  # the master is the compute weights, in the device's own memory
            else:
                weights = self._to_device(lambda host: host.copy_(master), None, count, self.compute_dtype, out)
            return {"weights": weights, "master": master}

        def master_as_weights(name: str, count: int, keep: bool, out: torch.Tensor | None) -> dict[str, torch.Tensor]:
            master = self._take(count, torch.float32, "pinned") if keep else None

            def fill(host: torch.Tensor) -> None:
                self.held_store.read_master(name, host)
                if master is not None:
                    master.copy_(host)  # widened here, before a staging buffer is handed back

            weights = self._to_device(fill, None, count, self.weights_dtype, out)
            return {"weights": weights} if master is None else {"weights": weights, "master": master}

        def job() -> dict[str, torch.Tensor]:
            if not borrowed:
                return weights_of(unit, numel, keep_master, None)
            total = numel + sum(n for _, n in borrowed)
            whole = (torch.empty(total, dtype=self.weights_dtype, device="meta") if self.mode == "meta"
                     else self._take(total, self.weights_dtype, "device"))
            offset = 0
            for owner, n in borrowed:
                weights_of(owner, n, False, whole[offset:offset + n])
                offset += n
            return {**weights_of(unit, numel, keep_master, whole[offset:]), "weights": whole}

        return self._on_side_stream(job)

    def load_ranges(self, unit: str, ranges: Sequence[tuple[int, int]], from_master: bool) -> Loaded:
        """Pieces (start, count) of a unit's compute weights laid end to end in one device buffer: a block's
        weights without its experts, or one group of them (streamer.store.layout.ExpertGroups). Each is read as
        `load_weights` reads a unit: from the compute copy in RAM, or (`from_master`) the master's elements,
        cast as a whole unit's are."""
        total = sum(count for _, count in ranges)

        def job() -> dict[str, torch.Tensor]:
            if self.mode == "meta":
                return {"weights": torch.empty(total, dtype=self.compute_dtype, device="meta")}
            whole, offset = self._take(total, self.compute_dtype, "device"), 0
            for start, count in ranges:
                out = whole[offset:offset + count]
                if from_master:
                    self._to_device(partial(self._read_master, unit, start), None, count, self.compute_dtype, out)
                else:
                    ram = self.held_store.slab(unit, "compute")
                    assert ram is not None  # a compute copy in RAM, else the weights load from the master
                    self._to_device(None, ram[start:start + count], count, self.compute_dtype, out)
                offset += count
            return {"weights": whole}

        return self._on_side_stream(job)

    def _read_master(self, unit: str, start: int, out: torch.Tensor) -> None:
        """Master elements [start, start + out.numel()) into `out`, converted to its dtype, read chunk by chunk (the
        state files' interleaved chunks). A chunk to convert is read into a pooled host buffer first, one the
        update's state chunks reuse."""
        store = self.held_store
        stored = store.spec.kind_dtype(store.spec.held_kind("master"))
        chunk, end = store.spec.chunk, start + out.numel()
        for first in range(start - start % chunk, end, chunk):
            low, high = max(start, first), min(end, first + chunk)
            piece = out[low - start:high - start]
            if piece.dtype == stored:
                store.read_state(unit, "master", low, piece)
                continue
            raw = self.buffers.take(high - low, stored)
            store.read_state(unit, "master", low, raw)
            piece.copy_(raw)
            self.buffers.give_back(raw)

    def load_state(self, unit: str, start: int, count: int, on_host: bool, with_grad: bool = True,
                   with_master: bool = True) -> Loaded:
        """fp32 master, exp_avg, exp_avg_sq and grad of one chunk (moments stored in bf16 are widened, in int8
        dequantized, by the store's `read_state`).

        `on_host`: the update runs on the host copy (update_on="host"), so nothing crosses the link.
        `with_grad=False`: the gradient comes from the backward (`host_chunk`), not from the store.
        `with_master=False`: so does the master (the one the unit's weights load kept).
        """
        store = self.store
        to_device = self._to_host_buffer if on_host else self._to_device
        kinds = [k for k in (*STATE_KINDS, "grad") if (k != "grad" or with_grad) and (k != "master" or with_master)]

        def job() -> dict[str, torch.Tensor]:
            out = {}
            for kind in kinds:
                ram = store.slab(unit, kind) if store is not None else None
                fill = partial(store.read_state, unit, kind, start) if store is not None else None
                out[kind] = to_device(fill, None if ram is None else ram[start:start + count], count, torch.float32)
            return out

        return self._on_side_stream(job)

    def host_chunk(self, total: torch.Tensor | None, start: int, count: int, on_host: bool) -> torch.Tensor:
        """A chunk of a unit's fp32 host tensor (its final gradient, or the master its weights load kept) where
        the update runs: a view where that is the host's own memory, else a device copy (a pooled buffer:
        `give_back` it)."""
        if self.mode == "meta":
            return torch.empty(count, dtype=torch.float32, device="meta")
        assert total is not None  # only a dry run (meta) has no host gradient or master
        piece = total[start:start + count]
        if on_host or self.mode == "shared":
            return piece
        out = self._take(count, torch.float32, "device")
        out.copy_(piece)  # synchronous: the next unit's fold reuses the host buffer
        return out

    def backward_chunk(self, pieces: Sequence[torch.Tensor], start: int, count: int) -> torch.Tensor:
        """A chunk of a unit's gradient as its backward made it on the device (one tensor per parameter, laid end
        to end), in fp32, in a device buffer of its own: `give_back` it."""
        if self.mode == "meta":
            return torch.empty(count, dtype=torch.float32, device="meta")
        return fold_into(self._take(count, torch.float32, "device"), pieces, first=True, start=start)

    def _to_host_buffer(self, fill: Callable[[torch.Tensor], object] | None, ram: torch.Tensor | None,
                        numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of `numel` elements for an update on the host: the RAM slab itself where it already has
        `dtype`, else a pooled buffer filled by `fill(host_tensor)` or copied from `ram`."""
        if self.mode == "meta":
            return torch.empty(numel, dtype=dtype, device="meta")
        if ram is not None and ram.dtype == dtype:
            return ram
        out = self._take(numel, dtype, "pinned")
        _fill_or_copy(out, fill, ram, lambda src: self.copier.copy_(out, src))
        return out

    def compute_target(self, unit: str, start: int, count: int, on_host: bool) -> torch.Tensor:
        """Where an update writes a chunk's new compute weights: straight into the RAM slab when it is reachable."""
        ram = self.store.slab(unit, "compute") if self.store is not None else None
        if ram is not None and (self.mode == "shared" or on_host):
            return ram[start:start + count]
        if self.mode == "meta":
            return torch.empty(count, dtype=self.compute_dtype, device="meta")
        return self._take(count, self.compute_dtype, "pinned" if on_host else "device")

    def fetch_input(self, stashed: Loaded) -> Loaded:
        """An offloaded block input (`stash_input`'s) back on the device, for its block's backward: the host tensor
        itself where host and device share memory; else copied on the side stream once its copy out is done, its
        pinned buffer pooled again once read."""
        host = stashed.tensors["input"]
        if self.mode != "cuda":
            return Loaded({"input": host})

        assert stashed.ready is not None and self.compute_stream is not None and self.stashes is not None  # CUDA
        stashes, compute_stream, copied_out = self.stashes, self.compute_stream, stashed.ready

        def job() -> dict[str, torch.Tensor]:
            torch.cuda.current_stream().wait_event(copied_out)  # the copy out, on the stash stream
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            out.record_stream(compute_stream)  # made on the side stream, used and freed on the compute one
            torch.cuda.current_stream().synchronize()  # the pinned buffer is reused next
            stashes.give_back(host)
            return {"input": out}

        return self._on_side_stream(job)

    # --- device -> host -------------------------------------------------------------------------------
    def stash_input(self, x: torch.Tensor) -> Loaded:
        """Start copying a block input to host memory, overlapping its block's forward: `wait()` makes the compute
        stream wait for the copy (so `x` may then be freed), and `fetch_input` takes it back. Where host and
        device share memory (and on meta) the input itself is the host tensor: nothing moves."""
        if self.mode != "cuda":
            return Loaded({"input": x})
        assert self.stashes is not None and self.stash_stream is not None and self.compute_stream is not None
        host = self.stashes.take(x.numel(), x.dtype).view(x.shape)
        self.stash_stream.wait_stream(self.compute_stream)  # x is written by the compute stream
        with torch.cuda.stream(self.stash_stream):
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stash_stream)
        return Loaded({"input": host}, done)

    def drop(self, x: torch.Tensor) -> None:
        """A block input now on the host leaves the device: its storage is freed, though autograd may still
        hold the tensor (the embedding's output, whose backward needs only its shape). Nothing where host and
        device share memory: there the input is the host copy."""
        if self.mode == "cuda":
            x.untyped_storage().resize_(0)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor (the same tensor where they share memory)."""
        if self.mode != "cuda":
            return t
        host = self._take(t.numel(), t.dtype, "pinned")
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return host

    def pieces_to_host(self, pieces: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Device tensors laid end to end, on the host: `pieces` itself where they share memory, else one
        pinned flat tensor they are copied into (each copy lands in place, with no device-side gather)."""
        if self.mode != "cuda":
            return pieces
        host = self._take(sum(p.numel() for p in pieces), pieces[0].dtype, "pinned")
        fold_into(host, pieces, first=True, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return [host]
