"""`Runtime`: the one wiring of a trainer's runtime, built once and read by every collaborator of a step.

It holds what a step is made from (the model, the step and optimizer settings, the seed), where it runs (the
device, and the compute dtype of the step's precision), the store it reads and writes, the sinks it reports to
(the ledger and the trace) and what moves the bytes (the transport and the I/O queues). `Executor`, `Loader`,
`Passes`, `Updater` and `Transport` take it whole instead of a dozen of its parts each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from layers import ModelConfig
from memory_model import Ledger, Trace
from memory_model.schedule import StepSpec, step_spec
from memory_model.step import Placement, StepConfig
from memory_model.units import Precision
from streamer.runtime.distributed import DataParallel
from streamer.runtime.lora import Adapters
from streamer.runtime.optim import OptimizerConfig
from streamer.runtime.transport import IOQueues, Transport
from streamer.store.interface import StoreReader, StoreWriter
from streamer.store.layout import DTYPES, ExpertGroups, UnitLayout, expert_groups


@dataclass(frozen=True, eq=False)
class Runtime:
    """`cfg`'s units made as `step` says (its precision resolved) and updated as `optimizer` says, computing on
    `device` from `store` (placed as `step.store`). `writer`: the same store where it takes writes (None: it is
    only read, and only forward passes run). `seed`: the run's, from which a bf16 master's stochastic rounding
    draws its bits. The rest is derived once, here: the compute and weights loads' torch dtypes, whether the
    compute weights are the masters, the blocks whose experts load in groups, and the transport and I/O queues
    (closed by `close`)."""

    cfg: ModelConfig
    step: StepConfig
    optimizer: OptimizerConfig
    device: torch.device
    store: StoreReader | None
    writer: StoreWriter | None
    ledger: Ledger
    trace: Trace
    layouts: dict[str, UnitLayout]
    data_parallel: DataParallel | None = None
    adapters: Adapters | None = None
    seed: int = 0
    dtype: torch.dtype = field(init=False)  # the compute dtype's (`precision.compute`)
    weights_dtype: torch.dtype = field(init=False)  # a 4-bit base's units load as their byte slabs
    compute_is_master: bool = field(init=False)  # the compute weights are the masters (one dtype): no copy
    groups: dict[str, ExpertGroups] = field(init=False)  # the blocks whose experts load in groups
    transport: Transport = field(init=False)
    io: IOQueues = field(init=False)

    def __post_init__(self) -> None:
        packed = any(layout.packed is not None for layout in self.layouts.values())
        dtype = DTYPES[self.precision.compute]
        derived = {
            "dtype": dtype,
            "weights_dtype": torch.uint8 if packed else dtype,
            "compute_is_master": self.precision.compute_is_master(frozen=self.adapters is not None),
            "groups": expert_groups(self.cfg, self.step.expert_group_size, self.layouts),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # (frozen: set once, here)
        object.__setattr__(self, "transport", Transport(self))  # reads the weights' dtype derived above
        if self.device.type == "cpu":  # the device's bytes are the host's: idle buffers give way to what it allocates
            self.ledger.add_listener(lambda _: self.transport.buffers.trim())
        inline_fold = (self.device.type == "cpu" and self.store is not None
                       and self.store.spec.placement.grad.zero_copy and self.data_parallel is None)
        object.__setattr__(self, "io", IOQueues(threaded=self.device.type != "meta" and self.step.prefetch > 0,
                                                inline_fold=inline_fold))

    @property
    def precision(self) -> Precision:
        """The step's dtypes, the compute dtype resolved."""
        return self.step.precision

    @property
    def placement(self) -> Placement:
        """Each slab kind's tier."""
        return self.step.store

    @property
    def processes(self) -> int:
        """The data-parallel processes: each computes its share of a step's batch."""
        return 1 if self.data_parallel is None else self.data_parallel.world

    @property
    def shards(self) -> int:
        """The slices of each unit's state: one per process where the state is sharded, else 1."""
        return 1 if self.data_parallel is None else self.data_parallel.shards

    def step_spec(self, micro_batches: int, fused: bool = False, backward: bool = True,
                  update_units: tuple[str, ...] | None = None) -> StepSpec:
        """A step of this runtime, made from its step settings as the planner makes it (`schedule.step_spec`):
        each process updates its slice of the state; `backward=False`: an evaluation; `update_units`: a step rolled
        forward."""
        return step_spec(self.cfg, self.step, self.compute_is_master, self.processes, self.adapters is not None,
                         micro_batches, fused, backward, update_units)

    def close(self) -> None:
        self.io.close()
        self.transport.close()
