"""Host memory and disk a run needs, checked before `streamer train` writes anything.

The store's size comes from its own layout (`StoreSpec.host_bytes`): RAM slabs for the RAM tier, and on the run
folder's filesystem every unit's state file, twice while a fused step or a RAM-tier save commits (the previous
generation stays until the manifest names the new one; the disk tier's journaled update after the backward keeps one
unit's twice at a time), plus, on the disk tier, its gradient file. With `--update-timing auto` a disk too small for
a fused step's second generation runs the update after the backward instead. On CUDA the transport's pool of staging
buffers (`StoreSpec.staging_bytes`) comes on top in RAM; of all that, `--pin-memory` says what is pinned
(page-locked: never swapped out): the slabs and the pool (all), the pool (staging) or nothing (none). Offloaded
activations (`--activations offload`) add every block's input of one micro-batch, pinned on CUDA unless none is.
Under torchrun each process keeps a store of its own: WORLD_SIZE stores go into the run folder, LOCAL_WORLD_SIZE of
them into this machine's RAM; with --data-parallel sharded each of them holds 1/WORLD_SIZE of every unit's state.
Each step a run keeps (--save-every, --keep-last, --keep-best) adds a copy of every unit's state file
(`StoreSpec.kept_bytes`), which no later commit frees; `check_keep_room` checks the room for one again before a step
is kept. The RAM a run may take is the machine's available memory, or less where the process is limited: its address
space (RLIMIT_AS, `ulimit -v`) less what it maps already, or its cgroup's memory limit less the group's use
(`available_ram`).

`streamer train` checks RAM against the process's host memory at its peak as the planner prices it
(`memory_model.host`, `advice.planned_host`): the store's RAM slabs, the staging pool, offloaded inputs, the disk
tier's gradient fold and state writes, on the cpu the device's own bytes, and the process itself. `HostNeed.of`
without that figure (a store alone) adds a fixed margin and a fraction instead (`RAM_HEADROOM`).
"""
from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from layers import PRESETS, ModelConfig
from memory_model import format_size
from memory_model.host import HostBytes
from memory_model.shapes import offloaded_inputs_bytes
from memory_model.units import DTYPE_BYTES
from streamer.advice import planned_host
from streamer.config import TrainerConfig
from streamer.run import RunConfig, RunError
from streamer.store.spec import StoreSpec

# Beside a store alone: the process itself (torch, the batch, CPU activations) in RAM; tokenizer, metrics and
# traces on disk. Both are small next to a model that comes near the limit, so a fixed margin plus a fraction.
RAM_HEADROOM = (2**30, 0.10)
DISK_HEADROOM = (64 * 2**20, 0.02)


@dataclass(frozen=True)
class HostNeed:
    """Bytes of RAM and of disk a run's stores need at their largest, headroom included, and of that RAM the
    bytes pinned (no headroom: they are exact)."""

    ram: int
    disk: int
    pinned: int = 0

    @classmethod
    def of(cls, model_cfg: ModelConfig, tc: TrainerConfig, stores_on_disk: int, stores_in_ram: int,
           offloaded: int = 0, kept: int = 0, host: HostBytes | None = None) -> HostNeed:
        """`offloaded`: the bytes of block inputs one process keeps in host memory (`--activations offload`);
        `kept`: the steps each store keeps (--keep-last, --keep-best), a copy of its state each; `host`: one
        process's host memory at its peak as planned, which replaces the store's RAM and its headroom."""
        spec = tc.store_spec(model_cfg, stores_on_disk)  # with the state sharded: each process's slice
        ram, disk = store_size(model_cfg, tc, stores_on_disk)
        disk += kept * spec.kept_bytes()
        cuda = tc.device.device.startswith("cuda")
        staging = spec.staging_bytes() if cuda else 0
        pinned = {"all": ram + staging, "register": ram + staging, "staging": staging,
                  "none": 0}[tc.device.pin_memory] if staging else 0
        pinned += offloaded if cuda and tc.device.pin_memory != "none" else 0
        ram += offloaded
        ram = host.total * stores_in_ram if host is not None else _with_headroom((ram + staging) * stores_in_ram,
                                                                                 RAM_HEADROOM)
        return cls(ram,
                   _with_headroom(disk * stores_on_disk, DISK_HEADROOM), pinned * stores_in_ram)

    def fits(self, free_ram: int, free_disk: int) -> bool:
        return self.ram <= free_ram and self.disk <= free_disk


def store_size(model_cfg: ModelConfig, tc: TrainerConfig, processes: int = 1) -> tuple[int, int]:
    """(RAM, disk) bytes of one process's store at its largest, headroom aside: its slabs and state files as
    the store lays them out (`StoreSpec.host_bytes`), a committing step's second generation included."""
    spec = tc.store_spec(model_cfg, processes)  # with the state sharded: each process's slice
    # A fused update is speculative: every unit's previous state stays until the commit.
    twice = not tc.step.store.state.durable or tc.step.fused(processes, tc.lora.enabled)
    return spec.host_bytes(every_unit_twice=twice)


# The journaled step's settings: its update is never fused, so no step that clips is made norm-first.
AFTER_BACKWARD = {"update_timing": "after-backward", "clipped_steps": "auto"}


def _with_headroom(nbytes: int, headroom: tuple[int, float]) -> int:
    return nbytes + headroom[0] + int(nbytes * headroom[1]) if nbytes else 0


# Where cgroup file systems are mounted (v2 unified, or v1's memory controller under memory/).
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def available_ram() -> tuple[int, str]:
    """(bytes, what bounds them): the RAM this process may still take. Past a process limit the allocator fails
    however much the machine has free, so the least of the machine's available memory, what RLIMIT_AS leaves
    beyond what the process maps now, and what its cgroups' memory limits leave."""
    bounds = [(psutil.virtual_memory().available, "available")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        left = max(0, soft - psutil.Process().memory_info().vms)
        bounds.append((left, f"left of the process's {format_size(soft)} address-space limit, ulimit -v"))
    cgroup = _cgroup_left()
    if cgroup is not None:
        bounds.append((cgroup[0], f"left of its cgroup's {format_size(cgroup[1])} memory limit"))
    return min(bounds)


def _cgroup_left() -> tuple[int, int] | None:
    """(bytes left, limit) of the tightest memory limit of this process's cgroups and their ancestors (v2's
    memory.max and memory.current, v1's memory.limit_in_bytes and memory.usage_in_bytes); None where none is set.
    In a container the process's own group is often the mount's root, so both the path and the root are read.

    A group's usage counts the page cache its processes read and wrote (a finished run's store files, say), which
    the kernel reclaims before it refuses the group memory: left is the limit less the usage, plus that cache,
    as the machine's available memory counts its own."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    folders: set[Path] = set()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        mount = CGROUP_ROOT if controllers == "" else CGROUP_ROOT / "memory" if "memory" in controllers.split(",") \
            else None
        if mount is not None:
            here = mount / path.lstrip("/")
            folders.update([here, *here.parents[:len(here.parents) - len(mount.parents)]])
    found = []
    for folder in folders:
        for limit_file, usage_file, cache in (("memory.max", "memory.current", ("active_file", "inactive_file")),
                                              ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                               ("total_active_file", "total_inactive_file"))):
            try:
                limit, usage = (folder / limit_file).read_text().strip(), int((folder / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < 2**60:  # "max", or v1's page-rounded 2**63: no limit
                found.append((max(0, int(limit) - usage + _cgroup_stat(folder, cache)), int(limit)))
    return min(found) if found else None


def _cgroup_stat(folder: Path, keys: tuple[str, ...]) -> int:
    """The sum of `keys` in the group's memory.stat (0 where it has none)."""
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(maxsplit=1) for line in lines if " " in line)
    return sum(int(values.get(key, "0")) for key in keys)


def check_host_resources(cfg: RunConfig, model_cfg: ModelConfig) -> tuple[RunConfig, str | None]:
    """`fit_host_resources` against this machine's available RAM and the run folder's free disk."""
    assert cfg.run_dir is not None  # resolved before the resources are checked
    folder = _existing_ancestor(Path(cfg.run_dir))
    # A read-only mount reports no free space (or a full disk's): say what it is, not "0 B free".
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        raise RunError(f"{folder} is on a read-only filesystem, where the run's store cannot be written; choose a "
                       "folder on a writable one with --run-dir")
    free_ram, bound = available_ram()
    return fit_host_resources(cfg, model_cfg, free_ram, shutil.disk_usage(folder).free, folder, bound)


def fit_host_resources(cfg: RunConfig, model_cfg: ModelConfig, free_ram: int, free_disk: int,
                       folder: Path, ram_bound: str = "available") -> tuple[RunConfig, str | None]:
    """The run's settings, if its stores fit, with a line saying what was changed to make them fit (or None).
    `--update-timing auto` on a disk with no room for a fused step's second generation of every unit becomes
    after-backward, whose journaled commit holds one unit's twice. Otherwise raise a RunError naming needed
    and free sizes and what would fit."""
    problem = shortfall(cfg, model_cfg, free_ram, free_disk, folder, ram_bound)
    if problem is None:
        return cfg, None
    if cfg.trainer.step.update_timing != "auto":
        raise RunError(problem)
    journaled = cfg.replace(**AFTER_BACKWARD)
    problem = shortfall(journaled, model_cfg, free_ram, free_disk, folder, ram_bound)
    if problem is None:
        return journaled, (f"--update-timing auto: a fused step keeps every unit's previous state on disk until it "
                           f"commits, and {folder} has {format_size(free_disk)} free, too little for that; the "
                           "update runs after the backward (a journaled commit holds one unit's state twice)")
    raise RunError(problem)


def shortfall(cfg: RunConfig, model_cfg: ModelConfig, free_ram: int, free_disk: int, folder: Path,
              ram_bound: str = "available") -> str | None:
    """Why the run cannot fit in `free_ram` (`ram_bound` says what bounds it) and `free_disk` (at `folder`), and what
    would; None if it fits."""
    on_disk, in_ram = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    tc = cfg.trainer
    offloaded = _offloaded(cfg, model_cfg, on_disk)
    kept = cfg.kept_copies()
    need, host = _need(cfg, model_cfg, on_disk, in_ram, offloaded, kept, free_ram, free_disk)
    if need.fits(free_ram, free_disk):
        return None
    short = []
    if need.ram > free_ram:
        pinned = f", {format_size(need.pinned)} pinned with --pin-memory {tc.device.pin_memory}" if need.pinned else ""
        inputs = f", {format_size(offloaded * in_ram)} of block inputs (--activations offload)" if offloaded else ""
        planned = f", at its peak as planned: {host.describe()}" if host is not None else ""
        short.append(f"{format_size(need.ram)} of RAM (--store {tc.step.store.tier}{inputs}{pinned}; "
                     f"{format_size(free_ram)} {ram_bound}{planned})")
    if need.disk > free_disk:
        speculative = not tc.step.store.state.durable or tc.step.fused(on_disk, tc.lora.enabled)
        generations = "every unit's" if speculative else "one unit's"
        copies = f", and {kept} kept step(s): --save-every, --keep-last, --keep-best" if kept else ""
        short.append(f"{format_size(need.disk)} of disk in {folder} ({generations} state twice while a step "
                     f"commits{copies}; {format_size(free_disk)} free)")
    # The least drastic change first: the exact optimizer before lower-precision moments, bf16 before int8, and
    # a bf16 master last.
    variants = {"--update-timing after-backward": AFTER_BACKWARD, "--store disk": {"store": "disk"}}
    for moments in ("bf16", "int8"):
        variants[f"--moment-dtype {moments}"] = {"moment_dtype": moments}
        variants[f"--store disk --moment-dtype {moments}"] = {"store": "disk", "moment_dtype": moments}
    for store in ("", "--store disk "):
        variants[f"{store}--master-dtype bf16 --moment-dtype int8"] = {
            **({"store": "disk"} if store else {}), "master_dtype": "bf16", "moment_dtype": "int8"}
    would_fit = []
    for flags, changes in variants.items():
        changed = tc.replace(**changes)
        if changed != tc and _need(cfg.replace(**changes), model_cfg, on_disk, in_ram, offloaded, kept, free_ram,
                                   free_disk)[0].fits(free_ram, free_disk):
            would_fit.append(flags)
            break  # the first, least drastic change that fits
    smaller = [(name, preset) for name, preset in PRESETS.items() if preset.num_params() < model_cfg.num_params()
               and HostNeed.of(preset, tc, on_disk, in_ram, _offloaded(cfg, preset, on_disk), kept).fits(
                   free_ram, free_disk)]
    kin = [(name, preset) for name, preset in smaller if preset.model_type == model_cfg.model_type]
    if smaller:  # the largest that fits, of the model's own family where one does
        would_fit.append(f"a smaller model (--model {max(kin or smaller, key=lambda p: p[1].num_params())[0]})")
    else:
        would_fit.append("a smaller model")
    if need.disk > free_disk:
        would_fit.append("a --run-dir on a filesystem with more free space")
    return f"the run's host store needs {' and '.join(short)}, headroom included; what would fit: " + \
        ", or ".join(would_fit)


def check_keep_room(root: Path, spec: StoreSpec, step: int) -> None:
    """Keeping `step` holds a copy of the state no later commit frees: the disk of the store `root` must have room
    for it (headroom included) before the step is kept."""
    need, free = _with_headroom(spec.kept_bytes(), DISK_HEADROOM), shutil.disk_usage(root).free
    if need > free:
        raise RunError(f"keeping step {step} needs {format_size(need)} of disk in {root} (a copy of the state that "
                       f"later steps do not free, headroom included; {format_size(free)} free): pass a lower "
                       "--keep-last (--save-every alone keeps every save), or free space, then run the same command "
                       "again")


def _need(cfg: RunConfig, model_cfg: ModelConfig, on_disk: int, in_ram: int, offloaded: int, kept: int,
          free_ram: int, free_disk: int) -> tuple[HostNeed, HostBytes | None]:
    """The run's need, its RAM as planned (and the plan's figure), where its store alone leaves room to plan it:
    planning a step walks its every event, seconds for thousands of blocks whose store no machine holds. An
    unresolved `--dtype auto` counts fp32's. Where the step cannot be planned (the checks after this one say
    why), or the store alone does not fit, the store with its headroom."""
    tc = cfg.trainer
    alone = HostNeed.of(model_cfg, tc, on_disk, in_ram, offloaded, kept)
    if alone.disk > free_disk or store_size(model_cfg, tc, on_disk)[0] * in_ram > free_ram:
        return alone, None
    try:
        resolved = tc.step.precision.resolved
        host = planned_host(model_cfg, cfg if resolved else cfg.replace(dtype="fp32"), on_disk)
    except ValueError:
        return alone, None
    return HostNeed.of(model_cfg, tc, on_disk, in_ram, offloaded, kept, host), host


def _offloaded(cfg: RunConfig, model_cfg: ModelConfig, processes: int) -> int:
    """Bytes of block inputs each process keeps in host memory under `--activations offload` (else none); an
    unresolved `--dtype auto` counts fp32's."""
    tc = cfg.trainer
    if tc.step.activations != "offload":
        return 0
    micro = cfg.batch // (tc.step.grad_accum * processes)
    return offloaded_inputs_bytes(model_cfg, micro, cfg.seq, DTYPE_BYTES.get(tc.step.precision.compute, 4))


def _existing_ancestor(path: Path) -> Path:
    """The run folder, or the nearest folder above it that exists: where it will be created."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
