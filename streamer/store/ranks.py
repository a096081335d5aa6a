"""Where a data-parallel run keeps its stores: one `rank<N>` folder per process under the run's store folder.

A run of one process keeps its store in the folder itself. Nothing here opens a store; it reads at most rank
0's manifest, to tell a sharded run (which one process may read as one store) from a replicated one.
"""
from __future__ import annotations

from pathlib import Path

from streamer.errors import StoreError
from streamer.store.commit import read_manifest


def rank_dir(run_store: Path, rank: int) -> Path:
    """The store of process `rank` of a data-parallel run."""
    return run_store / f"rank{rank}"


def every_store(run_store: Path) -> list[Path]:
    """Every process's store of the run whose stores are in `run_store`: its `rank<N>` folders, or itself."""
    return sorted(run_store.glob("rank*")) or [run_store]


def processes(run_store: Path) -> int:
    """How many processes trained the run whose stores are in `run_store`."""
    return len(every_store(run_store))


def is_sharded(run_store: Path) -> bool:
    """Whether the run's ranks each hold a slice of its state (`--data-parallel sharded`), not a whole copy."""
    return _shards(run_store) > 1


def _shards(run_store: Path) -> int:
    """The slices of every unit's state a data-parallel run's rank 0 holds (1: a whole copy)."""
    return read_manifest(rank_dir(run_store, 0))["spec"].get("shards", 1)


def store_dirs(run_store: Path, rank: int | None, world: int) -> list[Path]:
    """The store a process opens: `run_store` itself (`rank` None: no torchrun), or its rank's folder; for one
    process reading a run sharded over N processes (generate, export, eval), every rank's store, in rank order.
    A store written by another number of processes is refused, untouched, with the number to resume it with."""
    found = processes(run_store)
    if run_store.is_dir() and found != world:
        if rank is None and _shards(run_store) == found:
            return [rank_dir(run_store, r) for r in range(found)]
        how = f"torchrun --nproc-per-node {found}" if found > 1 else "one process (no torchrun)"
        raise StoreError(f"{run_store} holds the stores of {found} process(es) and this is {world}; resume "
                         f"it with {how}")
    return [run_store if rank is None else rank_dir(run_store, rank)]
