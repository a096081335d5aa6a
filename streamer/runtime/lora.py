"""LoRA's adapters on the device: every block's A and B in fp32, their gradients and torch's AdamW.

The base model streams read-only (memory_model/lora.py); these tensors never leave the device during a
run. A commit writes them with the optimizer's state to `lora-<step>.safetensors` in the store's folder, so
resuming continues bit-identically, and the export merges them into the base or writes them as a PEFT adapter.
The file's metadata holds an xxh3-64 checksum of the rest of it, as a state file's trailer does: a flipped bit
is an error naming the file, not a weight. Runs from before keep `lora-<step>.pt` (a pickle, no checksum),
which is still read.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Collection, Iterator

import safetensors.torch
import torch

from layers import ModelConfig
from layers.lora import delta_weight, init_adapters
from memory_model.lora import LoraConfig, check_targets, target_shape, targets_of
from streamer.errors import StoreError
from streamer.runtime.distributed import DataParallel
from streamer.runtime.optim import OptimizerConfig
from streamer.store.layout import UnitLayout
from streamer.store.slabfile import checksum_of, open_for_writing, refuse_link

_FORMAT = "weight-streaming-lora/1"
_OLD_SUFFIX = ".pt"  # a pickle of {"params", "optimizer"}, without a checksum


class Adapters:
    def __init__(self, cfg: ModelConfig, lora: LoraConfig, optimizer: OptimizerConfig, device: torch.device,
                 seed: int) -> None:
        check_targets(cfg, lora)
        self.cfg, self.lora, self.device, self.seed = cfg, lora, device, seed
        self.targets = targets_of(cfg, lora)  # the projections the adapters sit on
        self.keys = {target: cfg.lora().keys(target, self.targets) for target in self.targets}
        self.params: dict[str, dict[str, torch.Tensor]] = {}  # unit -> key in the unit -> fp32 leaf
        for i in range(cfg.num_hidden_layers):
            unit, tensors = f"block.{i}", {}
            torch.manual_seed(seed * 1_000_003 + 500_009 + i)  # per block, as the base is initialised per unit
            for target in self.targets:
                (fan_in, fan_out), rows = target_shape(cfg, target), lora.rank * cfg.lora().experts(target)[0]
                a, b = torch.empty(rows, fan_in), torch.empty(fan_out, rows)  # a mixture's experts' pairs stacked
                init_adapters(a, b)
                tensors[self.keys[target].a] = a.to(device).requires_grad_()
                tensors[self.keys[target].b] = b.to(device).requires_grad_()
            self.params[unit] = tensors
        self.optimizer = torch.optim.AdamW(
            self.leaves(), lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
            weight_decay=optimizer.weight_decay, foreach=False if device.type == "meta" else None)

    def leaves(self) -> list[torch.Tensor]:
        return [t for tensors in self.params.values() for t in tensors.values()]

    def numel(self) -> int:
        return sum(t.numel() for t in self.leaves())

    def storages(self) -> set[int]:
        """Identities of the adapters' storages: resident, so not an activation when autograd saves one."""
        return {t.untyped_storage()._cdata for t in self.leaves()}

    def for_unit(self, unit: str, dtype: torch.dtype, off: bool = False) -> dict[str, torch.Tensor]:
        """The unit's adapters in the compute dtype (a cast inside the graph: the gradient reaches the fp32
        leaves). `off`: zeros instead (one element each, expanded), so the unit computes its frozen base exactly
        (DPO's reference model, PEFT's adapters disabled)."""
        if off:
            return {key: t.new_zeros((), dtype=dtype).expand(t.shape) for key, t in self.params.get(unit, {}).items()}
        return {key: t.to(dtype) for key, t in self.params.get(unit, {}).items()}

    @contextlib.contextmanager
    def dropout_rng(self, step: int, micro: int, unit: str) -> Iterator[None]:
        """Dropout masks drawn from a seed of (step, micro-batch, unit): a checkpointed block's recompute
        draws the masks its forward drew, and a resumed run the masks an uninterrupted one would."""
        if self.lora.dropout == 0:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            index = int(unit.split(".")[1])
            torch.manual_seed(((self.seed * 1_000_003 + step) * 1_009 + micro) * 10_007 + index)
            yield

    # --- the update ---------------------------------------------------------------------------------------
    def grad_sq_norm(self) -> float:
        grads = [t.grad for t in self.leaves() if t.grad is not None]
        if not grads or self.device.type == "meta":
            return 0.0
        return float(sum(torch.linalg.vector_norm(g) ** 2 for g in grads))

    def all_reduce(self, data_parallel: DataParallel) -> None:
        """Average the adapters' gradients over the ranks (in fp32, in one flat tensor, as the base's are)."""
        grads = []
        for t in self.leaves():
            assert t.grad is not None  # every adapter takes part in the backward
            grads.append(t.grad)
        flat = data_parallel.finish_reduce(data_parallel.start_reduce(grads, whole=True))
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def step(self, lr: float, clip_coef: float) -> None:
        """AdamW on every adapter (torch's; decay on A and B, as HF Trainer decays every matrix)."""
        if self.device.type != "meta":
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if clip_coef != 1.0:
                for t in self.leaves():
                    assert t.grad is not None  # every adapter takes part in the backward
                    t.grad.mul_(clip_coef)
            self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)  # kept allocated: the ledger charges them for the run

    # --- weights out ------------------------------------------------------------------------------------
    def merge_into(self, unit: str, flat: torch.Tensor, layout: UnitLayout) -> None:
        """Add scaling * B @ A (each expert's B_e A_e) to the targeted weights of a unit's flat fp32 master (the
        merged export).

        `flat` is the unit's own stored slab, so its slots place the weights: a tied head's device weights
        would lead with the embedding's, which its slab does not hold (and only blocks have adapters)."""
        tensors = self.params.get(unit)
        if tensors is None:
            return
        slots = {slot.key: slot for slot in layout.slots}
        for target, keys in self.keys.items():
            slot = slots[keys.weight]
            a, b = tensors[keys.a].detach().cpu(), tensors[keys.b].detach().cpu()
            delta = delta_weight(a, b, self.cfg.lora().experts(target)[0], self.lora.scaling)
            flat[slot.offset:slot.offset + slot.numel].view(slot.shape).add_(delta.view(slot.shape))

    def hf_state_dict(self, prefix_of: dict[str, str]) -> dict[str, torch.Tensor]:
        """Adapters under PEFT's keys: 'base_model.model.transformer.h.0.attn.q_proj.lora_A.weight' (a mixture's
        experts': 'base_model.model.model.layers.0.mlp.experts.lora_A.weight')."""
        return {f"base_model.model.{prefix_of[unit]}{peft}": self.params[unit][ours].detach().cpu().contiguous()
                for unit in self.params for keys in self.keys.values()
                for ours, peft in ((keys.a, keys.peft_a), (keys.b, keys.peft_b))}

    # --- commits ------------------------------------------------------------------------------------------
    @staticmethod
    def path(folder: Path, step: int) -> Path:
        return folder / f"lora-{step:08d}.safetensors"

    def save(self, folder: Path, step: int) -> None:
        """Write the adapters and AdamW's state for `step` durably (an older step's file is left to `prune`)."""
        tensors = {f"params/{u}/{k}": t.detach().cpu().contiguous() for u, ts in self.params.items()
                   for k, t in ts.items()}
        optimizer = self.optimizer.state_dict()
        tensors.update({f"optimizer/{i}/{name}": value.detach().cpu().contiguous()
                        for i, state in optimizer["state"].items() for name, value in state.items()})
        metadata = {"format": _FORMAT, "param_groups": json.dumps(optimizer["param_groups"])}
        header, body = _split(safetensors.torch.save(tensors, metadata))
        header["__metadata__"]["checksum"] = str(_checksum(header, body))
        path = self.path(folder, step)
        partial = path.with_suffix(".partial")
        partial.unlink(missing_ok=True)  # a link left there goes, and what it points to stays as it is
        with os.fdopen(open_for_writing(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(_sealed_header(header))  # the tensors' offsets do not depend on the header's length
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        refuse_link(path)
        os.replace(partial, path)

    def prune(self, folder: Path, steps: Collection[int]) -> None:
        """After the store committed a step: the adapter files of other `steps` (it and the kept ones) go."""
        keep = {self.path(folder, step) for step in steps} | {_old_path(folder, step) for step in steps}
        for old in [*folder.glob("lora-*.safetensors"), *folder.glob(f"lora-*{_OLD_SUFFIX}")]:
            if old not in keep:
                old.unlink(missing_ok=True)

    @staticmethod
    def check(folder: Path, step: int) -> None:
        """The adapters of `step` in a store's `folder` are intact, where the store holds a LoRA run's (a
        `streamer.store.host.Companions`): a damaged or missing file raises the StoreError `load` would."""
        path = Adapters.path(folder, step)
        if path.is_file():
            _read(path)
        elif not _old_path(folder, step).is_file() and any(folder.glob("lora-*")):
            raise StoreError(f"{path} is missing: this LoRA run's adapters for step {step} are gone; restore the "
                             "file or start a new run")

    def load(self, folder: Path, step: int) -> None:
        path = self.path(folder, step)
        if path.is_file():
            state = _read(path)
        elif _old_path(folder, step).is_file():  # written before the file had a checksum
            state = torch.load(_old_path(folder, step), map_location="cpu", weights_only=True)
        else:
            raise StoreError(f"{path} is missing: this LoRA run's adapters for its last commit (step {step}) are "
                             "gone; restore the file or start a new run")
        try:
            with torch.no_grad():
                for unit, tensors in self.params.items():
                    for key, t in tensors.items():
                        t.copy_(state["params"][f"{unit}/{key}"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise StoreError(f"{path} does not hold this run's adapters ({exc}); restore the run directory from a "
                             "backup") from None


def _old_path(folder: Path, step: int) -> Path:
    return folder / f"lora-{step:08d}{_OLD_SUFFIX}"


def _split(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """A safetensors file's header (JSON) and its tensors' bytes (a view, not a copy)."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), memoryview(data)[8 + length:]


def _sealed_header(header: dict[str, Any]) -> bytes:
    """`header` as a safetensors file begins: its length, then its JSON padded with spaces to 8 bytes, as the
    format asks so that the tensors that follow stay aligned."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _checksum(header: dict[str, Any], tensors: bytes | memoryview) -> int:
    """xxh3-64 of the header (without its checksum) and every tensor byte."""
    fields = {**header, "__metadata__": {k: v for k, v in header.get("__metadata__", {}).items() if k != "checksum"}}
    return checksum_of(json.dumps(fields, sort_keys=True), tensors)


def _read(path: Path) -> dict[str, Any]:
    """The adapters and AdamW state of a `save`d file, once its checksum says it is whole."""
    damaged = StoreError(f"{path} is damaged (its checksum does not match its contents); restore the run "
                         "directory from a backup")
    try:
        data = path.read_bytes()
        header, tensors = _split(data)
        metadata = header["__metadata__"]
        ok = metadata["format"] == _FORMAT and metadata["checksum"] == str(_checksum(header, tensors))
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError):
        raise damaged from None
    if not ok:
        raise damaged
    loaded = safetensors.torch.load(data)
    state: dict[str, Any] = {"params": {}, "optimizer": {"state": {}, "param_groups":
                                                          json.loads(metadata["param_groups"])}}
    for name, value in loaded.items():
        kind, rest = name.split("/", 1)
        if kind == "params":
            state["params"][rest] = value
        else:
            index, key = rest.split("/")
            state["optimizer"]["state"].setdefault(int(index), {})[key] = value
    return state
