"""Storage tiers as records: what each place a slab kind may live says about itself. Torch-free.

A tier is its name (what `--store` and run.toml take, what a manifest holds) and the traits the code asks about:
whether a commit makes it durable and journals it, whether a load takes its slabs as they lie, whether it keeps
files in the run folder, and which of a `DeviceSpec`'s link figures price its reads and writes. `tier(name)` parses
a name once into its record; no other code compares tier names. The store runs each tier through a back end
(`streamer.store.interface.TierBackend`). Adding a tier (CXL memory, GPUDirect Storage, a second NVMe) is one
record here and one back end there.
"""
from __future__ import annotations

from typing import Any


class Tier(str):
    """A storage tier: its name, as users type it, with its traits.

    `durable`: what it holds survives the process; a commit writes it (a state file per unit and step), so the
    previous step's files remain to go back to. `journaled`: a step is journaled (its gradients made durable,
    then the journal written) before any weight changes, and rolled forward after a crash. `zero_copy`: its
    slabs lie in host memory, so a load takes one as it lies (on a CPU device, the slab itself); a compute-dtype
    copy of the weights is kept only on such a tier. `needs_folder`: it keeps its files in the run folder, which
    the trainer must be given. `link_figures`: the `DeviceSpec` figures its reads and writes are priced at
    (read, write), and which also bring the measured file costs (`KernelCosts.disk_*`); empty where its bytes
    cross no link of their own (host memory).
    """

    durable: bool
    journaled: bool
    zero_copy: bool
    needs_folder: bool
    link_figures: tuple[str, ...]

    def __new__(cls, name: str, *, durable: bool, journaled: bool, zero_copy: bool, needs_folder: bool,
                link_figures: tuple[str, ...]) -> "Tier":
        self = super().__new__(cls, name)
        self.durable, self.journaled, self.zero_copy = durable, journaled, zero_copy
        self.needs_folder, self.link_figures = needs_folder, link_figures
        return self

    @property
    def name(self) -> str:
        return str.__str__(self)

    @property
    def crosses_link(self) -> bool:
        """Its bytes cross a link of their own (`link_figures`): the disk's, for the disk tier."""
        return bool(self.link_figures)

    def __repr__(self) -> str:
        return repr(self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        return tier, (self.name,)


RAM = Tier("ram", durable=False, journaled=False, zero_copy=True, needs_folder=False, link_figures=())
DISK = Tier("disk", durable=True, journaled=True, zero_copy=False, needs_folder=True,
            link_figures=("disk_read_bw", "disk_write_bw"))

# Every tier by name, in the order flags and sweeps list them.
TIERS: dict[str, Tier] = {t.name: t for t in (RAM, DISK)}


def tier(name: Any) -> Tier:
    """The tier named `name` (a Tier is returned as it is); ValueError naming the tiers for anything else."""
    if isinstance(name, Tier):
        return name
    if isinstance(name, str) and name in TIERS:
        return TIERS[name]
    raise ValueError(f"must be one of {', '.join(repr(t) for t in TIERS)}, got {name!r}")
