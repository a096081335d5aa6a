"""One contender of `streamer bench`, alone in its own process so that its peak RSS is its own.

`python -m benchmarks.worker '<RunSpec JSON>'` builds the contender, runs `warmup` untimed and `steps`
timed optimizer steps on random token batches, and prints one line `BENCH-RESULT {json}` (other libraries
print freely on stdout; the tag marks ours). Contenders: our streamed trainer (RAM or disk tier), our
resident trainer, Hugging Face transformers + torch AdamW, transformers + bitsandbytes + PEFT's QLoRA, DeepSpeed
ZeRO-3 with CPU or NVMe offload. The model is any family's (`RunSpec.model`); transformers' class is the one its
config.json names.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
import traceback
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Callable

from memory_model import PlanConfig
from memory_model.step import StepConfig
from memory_model.tiers import TIERS, tier
from memory_model.trace import rss_high_water
from memory_model.units import COMPUTE_DTYPES, Precision
from memory_model.lora import LoraConfig
from memory_model.settings import Choice, Integer, Switch, Text, check_settings, same_setting, setting
from streamer import cpu_cache
from streamer.cli.launch import MALLOC_ENV
from streamer.config import TrainerConfig
from streamer.runtime.optim import OptimizerConfig

RESULT_TAG = "BENCH-RESULT "
CONTENDERS = ("stream", "resident", "hf", "hf-qlora", "deepspeed")
IO_COUNTERS = ("rchar", "wchar", "read_bytes", "write_bytes")
STORE_COUNTERS = ("store_read", "store_written")
RUSAGE_COUNTERS = ("minor_faults", "major_faults", "user_s", "system_s")
IO_PHASES, COMPUTE_PHASES = ("load", "offload"), ("forward", "backward", "update")


@dataclass(frozen=True, kw_only=True)  # keywords only: required settings follow defaulted ones
class RunSpec:
    """What one child measures. `tier` is where the training state lives: ram, or disk (DeepSpeed: nvme)."""

    label: str = setting(MISSING, "the contender's name in the tables", Text())
    contender: str = setting(MISSING, "whose trainer runs", Choice(CONTENDERS))
    model: dict[str, Any]  # ModelConfig.to_dict(): the model_type and its family's fields
    batch: int = same_setting(PlanConfig, "batch")
    seq: int = same_setting(PlanConfig, "seq")
    # compute dtype (ours), autocast dtype (HF), bf16 mixed precision (DeepSpeed)
    dtype: str = setting("bf16", "compute dtype", Choice(COMPUTE_DTYPES), "DTYPE")
    # A whole tier (the step's --store, as a word: every contender places all its state there)
    tier: str = setting("ram", "where the training state lives: ram, or disk (DeepSpeed: nvme offload)",
                        Choice(tuple(TIERS)), "TIER")
    moment_dtype: str = same_setting(Precision, "moments")
    master_dtype: str = same_setting(Precision, "master")
    activations: str = same_setting(StepConfig, "activations")  # the scale run checkpoints
    # Every contender clips at this global norm (0: none). Random tokens' gradients clip on every step, and a
    # fused update whose clipping triggers is made again after the backward: bench runs without, by default.
    max_grad_norm: float = same_setting(OptimizerConfig, "max_grad_norm")
    update_timing: str = same_setting(StepConfig, "update_timing")  # ours streamed only
    prefetch: int = same_setting(StepConfig, "prefetch")  # ours streamed only; the scale run loads two ahead
    warmup: int = setting(2, "untimed steps first", Integer(0))
    steps: int = setting(5, "timed steps", Integer())
    world: int = setting(1, "data-parallel processes (ours only); the parent starts one child per rank", Integer())
    threads: int = setting(0, "torch intra-op threads; 0 keeps torch's default", Integer(0))
    profile: bool = setting(False, "one more step under torch.profiler after the timed ones", Switch())
    workdir: str = setting("", "the folder of the contender's files", Text())
    seed: int = same_setting(TrainerConfig, "seed")
    lora_rank: int = same_setting(LoraConfig, "rank")  # ours streamed, and hf-qlora's adapters
    # The 4-bit base (ours streamed with lora_rank; hf-qlora's always), by BitsAndBytesConfig's names.
    load_in_4bit: bool = same_setting(LoraConfig, "load_in_4bit")
    bnb_4bit_quant_type: str = same_setting(LoraConfig, "bnb_4bit_quant_type")
    bnb_4bit_use_double_quant: bool = same_setting(LoraConfig, "bnb_4bit_use_double_quant")
    cpu_cache: bool = setting(True, "ours: torch's CPU allocator keeps freed buffers, as `streamer` sets it up "
                                    "(streamer.cpu_cache); off: torch's own allocator", Switch())

    def __post_init__(self) -> None:
        check_settings(self, lambda key, problem: ValueError(f"{key} {problem}"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))


@dataclass
class Measured:
    """What the child reports; lists hold one entry per timed step."""

    label: str
    ok: bool = True
    error: str = ""
    params: int = 0
    setup_s: float = 0.0
    warmup_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_rss_peak_bytes: int = 0  # VmHWM over the steps (the high-water mark is reset after setup)
    others_cores: float = 0.0  # CPU cores other processes kept busy meanwhile (the parent measures it)
    # VmHWM over the whole run, setup included (the higher of setup's and the steps'). Not ru_maxrss: Linux carries
    # the parent's high-water mark into a child across exec, so it would count the bench's own pages.
    process_rss_peak_bytes: int = 0
    planned_host_bytes: int = 0  # ours streamed: the planner's peak host memory of one process (memory_model.host)
    io: list[dict[str, int]] = field(default_factory=list)  # /proc/self/io deltas per timed step
    rusage: list[dict[str, float]] = field(default_factory=list)  # getrusage deltas per timed step (RUSAGE_COUNTERS)
    # The allocator settings of MALLOC_ENV the process started with (glibc reads them at start); {}: glibc's defaults
    malloc_env: dict[str, str] = field(default_factory=dict)
    cpu_cache: bool = False  # streamer.cpu_cache was torch's CPU allocator
    phases: list[dict[str, float]] = field(default_factory=list)  # ours: trace seconds per phase and step
    # ours: seconds of forward, backward and update spans per unit ('embed', 'block.N', 'head'), per timed step
    unit_compute: list[dict[str, float]] = field(default_factory=list)
    rss_peak_at: str = ""  # ours: the span that ended with the highest host RSS over the timed steps
    ledger_peak_bytes: int = 0
    ledger_peak_breakdown: dict[str, int] = field(default_factory=dict)
    fused: bool = False  # ours: the update is fused into the backward where no clipping triggers
    redone_steps: int = 0  # ours: timed fused steps that clipping made again after the backward
    profile: list[tuple[str, float, int]] = field(default_factory=list)  # (op, self CPU s, calls)
    experts: str = ""  # HF's: the experts implementation transformers picked, where the model has experts


# --- contenders ---------------------------------------------------------------------------------------------
class Contender:
    """A step function and, for ours, the trace of each step."""

    def __init__(self, step: Callable[[Any], float], params: int, trainer: Any = None, experts: str = "",
                 planned_host_bytes: int = 0) -> None:
        self.step, self.params, self.trainer, self.experts = step, params, trainer, experts
        self.planned_host_bytes = planned_host_bytes


def _config(spec: RunSpec) -> Any:
    from layers import ModelConfig
    return ModelConfig.from_dict(spec.model)


def _ours(spec: RunSpec) -> Contender:
    from layers import resident_model
    from streamer import StreamingTrainer, TrainerConfig
    from benchmarks.resident import ResidentTrainer
    cfg = _config(spec)
    tc = TrainerConfig.of(dtype=spec.dtype, store=spec.tier, activations=spec.activations,
                          moment_dtype=spec.moment_dtype, master_dtype=spec.master_dtype, seed=spec.seed,
                          max_grad_norm=spec.max_grad_norm,
                          lora_rank=spec.lora_rank, update_timing=spec.update_timing, prefetch=spec.prefetch,
                          load_in_4bit=spec.load_in_4bit, bnb_4bit_quant_type=spec.bnb_4bit_quant_type,
                          bnb_4bit_use_double_quant=spec.bnb_4bit_use_double_quant)
    if spec.contender == "stream":
        from streamer.advice import step_host
        planned = step_host(cfg, tc, tc.plan_config(spec.batch, spec.seq, spec.world)).total
        trainer = StreamingTrainer(cfg, tc, store_dir=Path(spec.workdir) / "store")
        return Contender(trainer.step, cfg.num_params(), trainer, planned_host_bytes=planned)
    resident = ResidentTrainer(cfg, tc, resident_model(cfg).state_dict())
    return Contender(resident.step, cfg.num_params())


def _hf_model(spec: RunSpec) -> Any:
    """transformers' class of the model's family (GPTJForCausalLM, LlamaForCausalLM, ...), HF's initialisation
    and its default attention."""
    from transformers import AutoConfig, AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config(spec).adapter().to_hf()))


def _hf(spec: RunSpec) -> Contender:
    """What a user writes: the family's transformers class, torch AdamW with decay / no-decay groups, clipping,
    autocast. A mixture's experts run as transformers picks by default (its `experts_implementation`)."""
    import torch
    model = _hf_model(spec)
    experts = model.get_experts_implementation()[""] if _config(spec).sparse_mlp is not None else ""
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

    step = _adamw_step(model, params, optimizer, spec.max_grad_norm, autocast=spec.dtype == "bf16")
    return Contender(step, sum(p.numel() for p in params), experts=experts)


def _adamw_step(model: Any, params: list[Any], optimizer: Any, max_grad_norm: float,
                autocast: bool = False) -> Callable[[Any], float]:
    """A transformers user's training step: the loss of the batch (under bf16 autocast where asked), its backward,
    clipping, the optimizer's step."""
    import torch

    def step(ids: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        return float(loss)

    return step


def _hf_qlora(spec: RunSpec) -> Contender:
    """QLoRA as a transformers user writes it: the model loaded 4-bit by bitsandbytes (BitsAndBytesConfig, from a
    folder: transformers quantizes on load), PEFT's LoRA of the same rank on its default targets, torch AdamW on the
    adapters, the matmuls in the compute dtype."""
    import peft
    import torch
    import transformers
    folder = Path(spec.workdir) / "hf-16bit"
    _hf_model(spec).save_pretrained(folder)
    compute = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=spec.bnb_4bit_quant_type,
                                                   bnb_4bit_use_double_quant=spec.bnb_4bit_use_double_quant,
                                                   bnb_4bit_compute_dtype=compute)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=compute,
                                                             device_map="cpu")
    model = peft.get_peft_model(base, peft.LoraConfig(r=spec.lora_rank, lora_alpha=int(LoraConfig().alpha),
                                                      lora_dropout=0.0))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    return Contender(_adamw_step(model, params, optimizer, spec.max_grad_norm), _config(spec).num_params())


def _deepspeed(spec: RunSpec) -> Contender:
    """ZeRO-3, parameters and optimizer offloaded to CPU memory or to NVMe files, one gloo process."""
    import logging
    import socket

    import torch
    import torch._dynamo  # noqa: F401  zero.Init patches tensor constructors; dynamo must import before it
    with socket.socket() as s:  # a free port for the one-process gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(launcher_env)
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if tier(spec.tier).zero_copy:
        offload = {"device": "cpu"}
    else:
        nvme = Path(spec.workdir) / "nvme"
        nvme.mkdir(parents=True, exist_ok=True)
        offload = {"device": "nvme", "nvme_path": str(nvme)}
    config = {
        "train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": spec.max_grad_norm,  # 0: none
        "bf16": {"enabled": spec.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload)},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _hf_model(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(ids: torch.Tensor) -> float:
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return Contender(step, _config(spec).num_params())


# --- measurement ---------------------------------------------------------------------------------------------
def _io_counters() -> dict[str, int]:
    """Bytes this process passed to read/write calls (rchar, wchar) and that reached the storage layer."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    raw = dict(line.split(": ") for line in lines)
    return {k: int(raw[k]) for k in IO_COUNTERS if k in raw}


def _rusage() -> dict[str, float]:
    """Page faults and CPU seconds of this process so far, every thread's (getrusage)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return dict(zip(RUSAGE_COUNTERS, (usage.ru_minflt, usage.ru_majflt, usage.ru_utime, usage.ru_stime), strict=True))


def _reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        pass


def _union_s(spans: list[Any]) -> float:
    """Wall seconds covered by at least one span (spans on several threads overlap)."""
    total, end = 0.0, float("-inf")
    for span in sorted(spans, key=lambda s: s.start_s):
        if span.end_s > end:
            total += span.end_s - max(span.start_s, end)
            end = span.end_s
    return total


def _phases(trainer: Any, step: int) -> dict[str, float]:
    spans = trainer.trace.spans(step)
    out = {phase: sum(s.duration_s for s in spans if s.phase == phase) for phase in (*COMPUTE_PHASES, *IO_PHASES)}
    for name, phases in (("load", ("load",)), ("offload", ("offload",)), ("io", IO_PHASES),
                         ("compute", COMPUTE_PHASES)):
        out[f"{name}_busy"] = _union_s([s for s in spans if s.phase in phases])
    return out


def _unit_compute(trainer: Any, step: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in trainer.trace.spans(step):
        if s.phase in COMPUTE_PHASES:
            out[s.layer] = out.get(s.layer, 0.0) + s.duration_s
    return out


def _rss_peak_at(trainer: Any, steps: range) -> str:
    """Where the host RSS was highest among the timed steps' spans: the first place to look when it is over plan."""
    spans = [s for step in steps for s in trainer.trace.spans(step)]
    top = max(spans, key=lambda s: s.host_rss_bytes, default=None)
    return "" if top is None else (f"{top.layer} {top.phase}, step {top.step}: "
                                   f"{top.host_rss_bytes / 2**30:.2f} GiB")


def _profile_step(step: Callable[[], float], rows: int = 15) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    averages = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    return [(a.key, a.self_cpu_time_total / 1e6, a.count) for a in averages[:rows]]


def measure(spec: RunSpec) -> Measured:
    import torch
    if spec.threads:
        torch.set_num_threads(spec.threads)
    out = Measured(spec.label)
    if spec.contender in ("stream", "resident") and spec.cpu_cache:  # as the `streamer` command starts
        out.cpu_cache = cpu_cache.install()
    start = time.perf_counter()
    builder = {"stream": _ours, "resident": _ours, "hf": _hf, "hf-qlora": _hf_qlora,
               "deepspeed": _deepspeed}[spec.contender]
    contender = builder(spec)
    out.setup_s, out.params, out.experts = time.perf_counter() - start, contender.params, contender.experts
    out.planned_host_bytes = contender.planned_host_bytes
    out.malloc_env = {k: os.environ[k] for k in MALLOC_ENV if k in os.environ}
    vocab = _config(spec).vocab_size
    generator = torch.Generator().manual_seed(spec.seed)

    def one_step() -> float:
        return contender.step(torch.randint(0, vocab, (spec.batch, spec.seq), generator=generator))

    setup_rss_peak = rss_high_water()
    cpu_cache.trim()  # as a run's loop starts (streamer.session)
    _reset_rss_peak()
    trainer = contender.trainer
    for _ in range(spec.warmup):
        t0 = time.perf_counter()
        one_step()
        out.warmup_s.append(time.perf_counter() - t0)
    redone_before = trainer.clipped_redos if trainer is not None else 0
    for _ in range(spec.steps):
        io_before, usage_before, t0 = _io_counters(), _rusage(), time.perf_counter()
        out.losses.append(one_step())
        out.step_s.append(time.perf_counter() - t0)
        usage_after, io_after = _rusage(), _io_counters()
        out.io.append({k: io_after[k] - io_before[k] for k in io_after})
        out.rusage.append({k: usage_after[k] - usage_before[k] for k in RUSAGE_COUNTERS})
        if contender.trainer is not None:
            out.phases.append(_phases(contender.trainer, contender.trainer.step_count))
            out.unit_compute.append(_unit_compute(contender.trainer, contender.trainer.step_count))
            # what the store's files were asked for (data only), the figure the planner prices
            out.io[-1].update(zip(STORE_COUNTERS, contender.trainer.step_bytes, strict=True))
    out.step_rss_peak_bytes = rss_high_water()
    out.process_rss_peak_bytes = max(setup_rss_peak, out.step_rss_peak_bytes)
    if trainer is not None:
        out.fused, out.redone_steps = trainer.fused, trainer.clipped_redos - redone_before
        out.ledger_peak_bytes = contender.trainer.ledger.peak
        last = trainer.step_count
        out.rss_peak_at = _rss_peak_at(trainer, range(last - spec.steps + 1, last + 1))
        out.ledger_peak_breakdown = contender.trainer.ledger.peak_breakdown
    if spec.profile:
        out.profile = _profile_step(one_step)
    return out


def main(argv: list[str]) -> int:
    spec = RunSpec.from_json(argv[0])
    try:
        result = measure(spec)
    except Exception as exc:  # reported to the parent, which records it in BENCHMARKS.md as the result
        traceback.print_exc()
        result = Measured(spec.label, ok=False, error=f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:2000])
    print(RESULT_TAG + json.dumps(dataclasses.asdict(result)), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
