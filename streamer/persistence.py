"""A trainer's persistence: its store created or opened, a step journaled and committed, a crashed update rolled
forward, the current step saved and kept. `Persistence` also holds what each commit records beside the state:
the losses so far and the caller's resumable state."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from layers import ModelConfig
from layers.packed_gguf import GGUFBase
from memory_model.schedule import step_events
from streamer.config import TrainerConfig
from streamer.errors import StoreError
from streamer.runtime.distributed import DataParallel, agree_on_journal, check_sharding
from streamer.runtime.executor import Executor
from streamer.runtime.hardware import DeviceConfig
from streamer.runtime.lora import Adapters
from streamer.runtime.step import StepContext
from streamer.runtime.wiring import Runtime
from streamer.store.commit import read_manifest
from streamer.store.host import DamagedStep, HostReader, HostStore, first_clause
from streamer.store.interface import StoreReader, StoreWriter
from streamer.store.ranks import store_dirs
from streamer.store.shards import MergedShards
from streamer.weights import write_fresh_state


def _pin_memory(device: str, pin_memory: str) -> str:
    """The store's pin_memory: what the settings ask for on CUDA, nothing elsewhere."""
    return pin_memory if device.startswith("cuda") else "none"


def create_store(cfg: ModelConfig, tc: TrainerConfig, store_dir: Path | None, processes: int) -> HostStore:
    """A new store for `cfg` with `tc`'s settings in `store_dir` (None: a temporary folder, RAM tiers only)."""
    spec, pin_memory = tc.store_spec(cfg, processes), _pin_memory(tc.device.device, tc.device.pin_memory)
    if store_dir is not None:
        return HostStore.create(store_dir, spec, pin_memory)
    if tc.step.store.needs_folder:
        raise StoreError("a disk-tier store needs store_dir (the run directory to write it in)")
    folder = Path(tempfile.mkdtemp(prefix="ws-store-"))
    try:
        store = HostStore.create(folder / "store", spec, pin_memory)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    store.remove_when_closed(folder)
    return store


def open_store(store_dir: str | Path, overrides: Mapping[str, Any] | None, read_only: bool,
               step: int | None) -> tuple[StoreReader, TrainerConfig, dict[str, Any] | None]:
    """An existing store (`StreamingTrainer.open`), the settings it was committed with under `overrides`, and the
    journal of an update a crash interrupted (None: none), which the ranks of a data-parallel run agree on."""
    device = dict(overrides or {}).get("device", "cpu")
    data_parallel = DataParallel.from_environment(device)
    rank, world = (None, 1) if data_parallel is None else (data_parallel.rank, data_parallel.world)
    dirs = store_dirs(Path(store_dir), rank, world)  # several: a sharded run, read in one process
    # The store's RAM slabs are pinned (or not) as they are allocated, before its trainer settings are read:
    # pin_memory comes from the overrides, else from the settings the store was committed with.
    try:
        committed = read_manifest(dirs[0]).get("trainer", {}).get("config", {})
    except StoreError:  # the store's open says what is wrong, or goes back to a kept step
        committed = {}
    settings = {**committed, **dict(overrides or {})}
    pin_memory = _pin_memory(str(settings.get("device", "cpu")),
                                  settings.get("pin_memory", DeviceConfig.pin_memory))
    if step is not None and not read_only:
        raise StoreError("a kept step is opened read_only; training continues from the last commit (or goes "
                         "back to a kept step where that is damaged)")
    if step is not None and len(dirs) > 1:
        raise StoreError(f"{store_dir} holds a sharded run, whose kept steps cannot be read yet; read its last "
                         "step (no --step)")
    store: StoreReader
    if len(dirs) > 1:
        store = MergedShards.open(dirs)
    elif read_only:
        store = HostReader.open(dirs[0], pin_memory, step=step, companions=Adapters.check)
    elif data_parallel is None:
        store = HostStore.open(dirs[0], pin_memory, companions=Adapters.check)
    else:
        store = _open_together(dirs[0], pin_memory, data_parallel)
    try:  # on any error, let go of the store (and its lock) before saying why
        writer = store if isinstance(store, StoreWriter) else None
        journal = None if writer is None else writer.journal  # a reader refuses one at open
        if data_parallel is not None:
            agreed = agree_on_journal(data_parallel, store.step, journal)
            if writer is not None and journal is not None and agreed is None:
                writer.discard_journal()  # another rank never journaled it, so no rank updated anything of it
            journal = agreed
        saved = dict(store.trainer_state.get("config", {}))
        tc = TrainerConfig.from_dict({**saved, **dict(overrides or {})})
        check_sharding(store, tc.step.data_parallel, data_parallel)
        if tc.step.store != store.spec.placement:
            raise StoreError(f"{store.root} was created with placement {store.spec.placement.to_dict()}; "
                             "the placement of an existing store cannot change")
        if store.spec.frozen and not tc.lora.enabled:
            raise StoreError(f"{store_dir} holds a LoRA run's frozen base only; resume it with its --lora-rank")
        if store.spec.quant_type == "gguf":  # the file's types are the store's, not a setting
            tc = tc.on_base(GGUFBase(store.spec.gguf_types))
    except BaseException:
        store.close()
        raise
    return store, tc, journal


def _open_together(root: Path, pin_memory: str, parallel: DataParallel) -> HostStore:
    """This torchrun process's store, opened as every process opens its own. Where any is damaged, every process
    goes back to the newest step intact in all of them (`HostStore.intact_steps`), as one process goes back to its
    newest intact kept step; where none is, or a store cannot be opened for another reason, every process says which
    process's store in one line."""
    store, error = None, None
    try:
        store = HostStore.open(root, pin_memory, fall_back=False, companions=Adapters.check)
    except StoreError as exc:
        error = exc
    views = parallel.gather(None if error is None else (isinstance(error, DamagedStep), " ".join(str(error).split())))
    failed = {rank: view for rank, view in enumerate(views) if view is not None}
    if not failed:
        assert store is not None
        return store
    if store is not None:
        store.close()
    if not all(damaged for damaged, _ in failed.values()):  # not a damaged step: nothing to go back to
        if error is not None:
            raise error
        rank, (_, line) = next((rank, view) for rank, view in failed.items() if not view[0])
        raise StoreError(f"rank {rank}'s store: {line}")
    damage = "; ".join(f"rank {rank}'s store: {first_clause(line)}" for rank, (_, line) in failed.items())
    common = set.intersection(*map(set, parallel.gather(HostStore.intact_steps(root, pin_memory, Adapters.check))))
    if not common:
        raise StoreError(f"{damage}: no step is intact in every process's store; restore the run directory from a "
                         "backup, or start a new run")
    step = max(common)
    store = HostStore.open(root, pin_memory, to_step=step, companions=Adapters.check)
    store.fell_back = (f"{damage}, so the run goes back to step {step}, the newest step intact in every process's "
                       "store (the steps after it are trained again)")
    return store


class Persistence:
    """Commits of `rt`'s store (none where it has none: a dry run), with `tc` recorded in each."""

    def __init__(self, rt: Runtime, executor: Executor, tc: TrainerConfig) -> None:
        self.rt, self.executor, self.tc = rt, executor, tc
        self.losses: list[float] = []
        self.extra_state: dict[str, Any] = {}  # the caller's resumable state (data order, RNG), committed per step

    def writable(self) -> StoreWriter:
        """The store, to change it; one opened for reading says why it takes no writes."""
        if self.rt.writer is None:
            assert self.rt.store is not None
            raise StoreError(self.rt.store.read_only_reason)
        return self.rt.writer

    def trainer_state(self, extra_losses: list[float] | None = None) -> dict[str, Any]:
        return {"config": self.tc.to_dict(), "losses": self.losses + (extra_losses or []),
                "extra": self.extra_state}

    def resume(self, journal: dict[str, Any] | None) -> None:
        """After `open_store`: the committed step's losses, caller's state and adapters, and the update a crash
        interrupted finished."""
        store = self.rt.store
        assert store is not None
        if self.rt.adapters is not None:
            self.rt.adapters.load(store.root, store.step)
        self.losses = list(store.trainer_state.get("losses", []))
        self.extra_state = dict(store.trainer_state.get("extra", {}))
        if journal is not None:
            self.roll_forward(journal)

    def write_units(self, tensors_of: Callable[[str], dict[str, torch.Tensor]]) -> None:
        """Every unit's weights (by slot key) as a fresh state, committed as the store's current step."""
        assert self.rt.store is not None
        for unit in self.rt.cfg.unit_names():
            write_fresh_state(self.writable(), self.rt.layouts[unit], tensors_of(unit), self.rt.dtype,
                              self.rt.data_parallel)
        self.finish_step(self.rt.store.step)

    def journal(self, ctx: StepContext, loss: float) -> None:
        """Before the step's first update (its loss, finite, is `loss`): the step is journaled (durable)."""
        if self.rt.store is not None:
            state = self.trainer_state(extra_losses=[loss])
            self.writable().begin_step(ctx.step, {"lr": ctx.lr, "clip_coef": ctx.clip_coef, "trainer": state})
        if self.rt.data_parallel is not None:
            self.rt.data_parallel.barrier()  # no rank updates a weight before every rank has journaled the step

    def finish_step(self, step: int) -> None:
        """Commit a step; a LoRA run's adapters are written first where the store commits to disk."""
        store, adapters = self.rt.store, self.rt.adapters
        assert store is not None
        durable = store.spec.placement.state.durable
        if adapters is not None and durable:
            adapters.save(store.root, step)
        self.writable().finish_step(step, self.trainer_state())
        if adapters is not None and durable:
            adapters.prune(store.root, {step, *store.kept()})

    def roll_forward(self, journal: dict[str, Any]) -> None:
        """Finish an update a crash interrupted: the same gradients, lr and clip coefficient, so bit-identical."""
        writer = self.writable()
        step = journal["step"]
        pending = [u for u in self.rt.cfg.unit_names() if writer.unit_version(u) != step]
        ctx = StepContext([], step, journal["lr"], clip_coef=journal["clip_coef"])
        # No micro-batch is left to run: the step is the update of the units it had not finished.
        self.executor.run(step_events(self.rt.step_spec(0, update_units=tuple(pending))), ctx)
        trainer_state = journal["trainer"]
        self.losses = list(trainer_state.get("losses", []))
        self.extra_state = dict(trainer_state.get("extra", {}))
        writer.finish_step(step, trainer_state)

    def save(self) -> None:
        """Make the current step durable (the disk tier already is after every step)."""
        store, adapters = self.rt.store, self.rt.adapters
        if store is not None:
            writer = self.writable()
            if adapters is not None:
                adapters.save(writer.root, writer.step)
            writer.save(self.trainer_state())
            if adapters is not None:
                adapters.prune(store.root, {store.step, *store.kept()})

    def keep(self, note: dict[str, Any] | None = None) -> None:
        """Keep the last commit: no later step deletes its state (or a LoRA run's adapters)."""
        self.writable().keep(dict(note or {}))

    def drop_kept(self, step: int) -> None:
        """Let a kept step go: its state files are deleted (the LoRA run's adapters at the next commit)."""
        self.writable().drop_kept(step)

    def kept(self) -> dict[int, dict[str, Any]]:
        """The kept steps, oldest first, with their notes."""
        return {} if self.rt.store is None else self.rt.store.kept()
