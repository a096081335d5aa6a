"""What a host store holds and how its state files are laid out: `StoreSpec`, written into every manifest.

Torch appears only for dtypes; nothing here reads or writes a file.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from layers import ModelConfig
from layers.packed_gguf import GGUFBase
from layers.quant4 import FrozenQuant, Quant4, Quant8
from layers.quant_gguf import QuantGGUF
from memory_model.host import frozen_staging_bytes, staging_pool_bytes
from memory_model.schedule import chunks, shard_numel
from memory_model.settings import SettingError, Switch, check_settings, same_setting, setting
from memory_model.step import Placement, StepConfig, check_chunk_blocks
from memory_model.units import BLOCK_SCALE_BYTES, QUANT_BLOCK, Precision, stored_bytes
from streamer.errors import StoreError
from streamer.store.layout import DTYPES, UnitLayout, model_layouts
from streamer.store.slabfile import TRAILER_BYTES

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
# Host memory pinned for copies to and from a CUDA device (page-locked, so the DMA engine reads it while the host
# works on): the RAM store's slabs too (copied into torch's pinned memory, or registered where they lie), only a
# bounded pool of staging buffers, or nothing.
PIN_MODES = ("all", "register", "staging", "none")


def _error(key: str, problem: str) -> StoreError:
    return StoreError(f"{key} {problem}")


@dataclass(frozen=True)
class StoreSpec:
    """What a store holds: its dtypes (`precision`, the compute dtype resolved), placement and chunk are the step's
    settings (`StepConfig`'s), as the trainer that creates it has them (`TrainerConfig.store_spec`)."""

    config: ModelConfig
    precision: Precision = Precision("bf16")
    placement: Placement = same_setting(StepConfig, "store")
    # Also the interleave unit of state files.
    chunk: int = same_setting(StepConfig, "update_chunk")
    # Data parallel with the state sharded: this store holds one rank's `shard_numel` slice of every unit.
    shards: int = 1
    # LoRA trains adapters beside a frozen base: the store then holds the base's compute weights alone, written
    # once (no master, no moments, no gradient), and a step only reads them.
    frozen: bool = setting(False, "the base is frozen (LoRA): only its compute weights are stored", Switch())
    # A frozen base held 4-bit or 8-bit (QLoRA, layers/packed4.py): its compute weights are each unit's byte slab.
    quant_type: str = ""  # "" (16-bit), "nf4", "fp4" or "int8"; "gguf": a GGUF file's blocks (layers/packed_gguf.py)
    double_quant: bool = False
    gguf_types: tuple[tuple[str, str], ...] = ()  # a GGUF base's type of each weight (`GGUFBase.types`)

    def __post_init__(self) -> None:
        check_settings(self, _error)
        if not self.precision.resolved:
            raise StoreError(f"a store holds its compute weights in bf16 or fp32, not {self.precision.compute}")
        if self.quant_type and not self.frozen:
            raise StoreError("a 4-bit base is frozen: a store holding one trains LoRA's adapters (--lora-rank)")
        if not self.placement.compute.zero_copy and not self.placement.state.durable:
            # Disk compute weights are cast from the state files' masters, which a RAM-state store writes only
            # on save().
            raise StoreError("placement compute='disk' needs state='disk' (compute weights are read from the "
                             "state files' fp32 masters); use store='disk' or keep compute in RAM")
        try:
            check_chunk_blocks(self.chunk, self.precision.moments)
        except SettingError as exc:
            raise StoreError(str(exc)) from None

    def stored_numel(self, unit_numel: int) -> int:
        """Elements of a unit of `unit_numel` parameters this store holds: the whole unit, or one rank's slice."""
        return shard_numel(unit_numel, self.shards)

    @property
    def compute_is_master(self) -> bool:
        return self.precision.compute_is_master(self.frozen)

    def quant4(self) -> FrozenQuant | None:
        """How the base is held quantized (its 16-bit tensors in the compute dtype); None: it is not."""
        if self.quant_type == "gguf":
            return QuantGGUF(GGUFBase(self.gguf_types), DTYPES[self.precision.compute])
        if self.quant_type == "int8":
            return Quant8(DTYPES[self.precision.compute])
        return Quant4(self.quant_type, self.double_quant, DTYPES[self.precision.compute]) if self.quant_type else None

    def layouts(self) -> tuple[UnitLayout, ...]:
        """Every unit's layout in this store's slabs."""
        return model_layouts(self.config, self.quant4())

    def kind_dtype_name(self, kind: str) -> str:
        if kind == "grad":
            return "fp32"
        if kind == "master":
            return self.precision.master
        return self.precision.compute if kind == "compute" else self.precision.moments

    def quantized(self, kind: str) -> bool:
        """The kind is stored block-wise quantized (streamer.store.quant): as bytes, not as its elements."""
        return self.kind_dtype_name(kind) in BLOCK_SCALE_BYTES

    def held_kind(self, kind: str) -> str:
        """The kind a read of `kind` returns: a frozen base's "master" is its compute weights, the one kind it holds."""
        return "compute" if kind == "master" and self.frozen else kind

    def kind_dtype(self, kind: str) -> torch.dtype:
        """The dtype of the kind's slab and file pieces: its elements', or bytes (uint8) where it is quantized (a
        4-bit base's compute weights: bytes, `UnitLayout.numel` of them)."""
        as_bytes = self.quantized(kind) or (kind == "compute" and bool(self.quant_type))
        return torch.uint8 if as_bytes else DTYPES[self.kind_dtype_name(kind)]

    def kind_bytes(self, kind: str, count: int) -> int:
        """Bytes `count` elements of `kind` take in a slab or a state file (memory_model.units.stored_bytes)."""
        if kind == "compute" and self.quant_type:
            return count
        return stored_bytes(self.kind_dtype_name(kind), count)

    def kind_range(self, kind: str, start: int, count: int) -> tuple[int, int]:
        """Where elements [start, start + count) of `kind` lie in its slab, in the slab's own items (`kind_dtype`);
        a quantized kind's range starts on a block (update chunks are whole blocks)."""
        if not self.quantized(kind):
            return start, start + count
        if start % QUANT_BLOCK:
            raise ValueError(f"a range of quantized {kind} starts on a block of {QUANT_BLOCK}, not at {start}")
        first = self.kind_bytes(kind, start)
        return first, first + self.kind_bytes(kind, count)

    def stored_kinds(self) -> tuple[str, ...]:
        """Kinds the store holds, in its files or its RAM slabs, gradients aside: no compute copy on the disk
        tier (loads cast the master) nor in fp32 (the compute weights are the masters)."""
        return tuple(dict.fromkeys(k for k in (*self.file_kinds(), *self.ram_kinds()) if k != "grad"))

    def file_kinds(self) -> tuple[str, ...]:
        """Kinds stored, chunk-interleaved, in a unit's state file. No compute-dtype copy: with compute on
        disk a load reads the fp32 master and casts it, so a step reads the master once for the backward and
        the update together and never writes a copy (docs/STORE.md). A frozen base stores its compute weights
        alone."""
        return ("compute",) if self.frozen else STATE_KINDS

    def ram_kinds(self) -> tuple[str, ...]:
        """Kinds held in RAM slabs, those on a zero-copy tier (pinned on CUDA); fp32 compute weights are the master
        weights, not a copy."""
        tiers = {"compute": self.placement.compute}
        if not self.frozen:
            tiers.update({"grad": self.placement.grad, **{k: self.placement.state for k in STATE_KINDS}})
        return tuple(k for k, tier in tiers.items()
                     if tier.zero_copy and not (k == "compute" and self.compute_is_master))

    def chunk_bytes(self, count: int) -> int:
        """Bytes of one chunk of `count` parameters in a state file (every file kind, interleaved)."""
        return sum(self.kind_bytes(k, count) for k in self.file_kinds())

    def state_bytes(self, numel: int) -> int:
        """Data bytes of a state file of a unit of `numel` parameters (the trailer follows them)."""
        return sum(self.chunk_bytes(c) for _, c in chunks(numel, self.chunk))

    def host_bytes(self, every_unit_twice: bool = True) -> tuple[int, int]:
        """(RAM, disk) bytes of the whole store at its largest. State files are written on every commit (the RAM
        tier's on a save), and the old generation of a unit is deleted only once its new one is in place. A
        journaled commit (the disk tier's update after the backward) deletes each old one at once, so one unit
        at a time has two; a speculative (fused) step or a save keeps every old one until the manifest names
        the new ones (`every_unit_twice`). Disk-tier gradients have a file of their own. A frozen base's state
        files are written once, when its weights are (nothing a step does changes them)."""
        ram, states, largest, grads = self._sizes()
        second = 0 if self.frozen else states if every_unit_twice else largest
        return ram, states + second + grads

    def kept_bytes(self) -> int:
        """Disk bytes a kept step holds that no later commit frees: every unit's state file (none for a frozen
        base, whose files no step rewrites)."""
        return 0 if self.frozen else self._sizes()[1]

    def _sizes(self) -> tuple[int, int, int, int]:
        """(RAM slabs, state files, the largest state file, gradient files) in bytes. Sized once per unit type
        (`_unit_kinds`): every block has the same shapes, and laying one out and summing its chunks takes ~1 ms."""
        grads_on_disk = self.placement.grad.crosses_link and not self.frozen
        ram = states = largest = grads = 0
        for unit, units in self._unit_kinds():
            numel = self.stored_numel(UnitLayout.of(self.config, unit, self.quant4()).numel)
            state = self.state_bytes(numel) + TRAILER_BYTES
            ram += units * sum(self.kind_bytes(k, numel) for k in self.ram_kinds())
            states, largest = states + units * state, max(largest, state)
            grads += units * self.kind_bytes("grad", numel) if grads_on_disk else 0
        return ram, states, largest, grads

    def staging_bytes(self) -> int:
        """The bound of the transport's pool of staging buffers (`streamer.runtime.transport.StagingPool`):
        buffers asked for beyond it are plain pageable memory, so pinned staging never exceeds it. A frozen base's
        holds one buffer of each unit slab's size (`frozen_staging_bytes`)."""
        if self.frozen:
            return frozen_staging_bytes(self.kind_bytes("compute", self.stored_numel(layout.numel))
                                        for layout in self.layouts())
        largest = max(self.stored_numel(UnitLayout.of(self.config, unit, self.quant4()).numel)
                      for unit, _ in self._unit_kinds())
        return staging_pool_bytes(largest, self.chunk, self.placement.loads_read_master(self.compute_is_master))

    def _unit_kinds(self) -> list[tuple[str, int]]:
        """One unit of each type and how many units it stands for: every block has the same shapes. A GGUF base's
        blocks may each hold other types: each unit stands for itself."""
        if self.quant_type == "gguf":
            return [(unit, 1) for unit in self.config.unit_names()]
        count = Counter(unit.split(".")[0] for unit in self.config.unit_names())
        return [(unit, count[kind]) for kind, unit in {u.split(".")[0]: u for u in self.config.unit_names()}.items()]

    def kind_offset(self, kind: str, start: int, count: int) -> int:
        """Byte offset, in a state file, of `kind`'s piece of the chunk of `count` elements starting at element
        `start` (chunks are interleaved: every file kind of chunk 0, then of chunk 1, ...)."""
        if start % self.chunk:
            raise ValueError("state ranges start on chunk boundaries")
        offset = (start // self.chunk) * self.chunk_bytes(self.chunk)
        for k in self.file_kinds():
            if k == kind:
                return offset
            offset += self.kind_bytes(k, count)
        raise KeyError(kind)

    def to_dict(self) -> dict[str, Any]:
        sharded = {"shards": self.shards} if self.shards > 1 else {}  # a whole store's manifest reads as before
        quant = {"quant_type": self.quant_type, "double_quant": self.double_quant} if self.quant_type else {}
        if self.gguf_types:
            quant["gguf_types"] = [list(pair) for pair in self.gguf_types]
        precision = self.precision
        return {"config": self.config.to_dict(), "compute_dtype": precision.compute,
                "moment_dtype": precision.moments, "placement": self.placement.to_dict(), "chunk": self.chunk,
                **sharded, "frozen": self.frozen, "master_dtype": precision.master, **quant}

    @classmethod
    def from_dict(cls, raw: Any) -> "StoreSpec":
        try:
            # A store written before `frozen` existed holds a full training state, whatever its run trained; one
            # written before `master_dtype` existed, fp32 masters.
            optional = {"shards", "frozen", "master_dtype", "quant_type", "double_quant", "gguf_types"}
            if set(raw) - optional != {"config", "compute_dtype", "moment_dtype", "placement", "chunk"}:
                raise ValueError(f"fields {sorted(map(str, raw))}")
            precision = Precision(raw["compute_dtype"], raw.get("master_dtype", "fp32"), raw["moment_dtype"])
            return cls(ModelConfig.from_dict(raw["config"]), precision, Placement(**raw["placement"]), raw["chunk"],
                       raw.get("shards", 1), raw.get("frozen", False), raw.get("quant_type", ""),
                       raw.get("double_quant", False),
                       tuple((str(key), str(kind)) for key, kind in raw.get("gguf_types", ())))
        except (ValueError, KeyError, TypeError) as exc:  # layers' ConfigError is a ValueError
            raise StoreError(f"store spec is malformed ({exc})") from None
