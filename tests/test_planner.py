"""The planner: activation formulas measured on the real layers, the charging walk replayed on a Ledger,
the GPT-J-6B bar, time-model properties and the JSON of a plan."""
from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from layers import FAMILIES, PRESETS, GPTJConfig, GptOssConfig, ModelConfig, build_unit
from memory_model import (CATEGORIES, device_spec, DEVICE_PRESETS, DeviceSpec, Ledger, Link, PlanConfig,
                          peak_device_bytes, plan)
from memory_model.allocator import workspace_bytes
from memory_model.kernels import attention_flops, gpu_elementwise_bytes
from memory_model.devices import tree_levels, with_sets
from memory_model.units import stored_bytes
from memory_model.planner import planned_spec
from memory_model.shapes import (backward_workspace_bytes, block_backward_transient_bytes, block_input_numel,
                                 block_saved_bytes, checkpoint_input_bytes, embed_saved_bytes, head_saved_bytes,
                                 loss_vocab_chunk)
from memory_model.schedule import (
    BlockInput, StepSpec, released_after, resident_sets, resource_charges, step_events, update_charges,
)

GIB = 2**30
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CS2 = DEVICE_PRESETS["cs2"]
GPTJ_6B = GPTJConfig.preset("gptj-6b")


# --- measuring what autograd saves ------------------------------------------------------------------------------
class SavedStorages:
    """Like the runtime's recorder: each saved storage charged once, to the first unit that saves it,
    parameters excluded (the runtime packs streamed weights as handles)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.owner: dict[int, str] = {}
        self.bytes: dict[str, int] = {}
        # Each charged storage held: a unit's graph may be gone before the next unit runs, and a storage of the
        # next one at a freed one's address must not pass for it.
        self.held: list[torch.UntypedStorage] = []

    def charge(self, unit: str, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key not in self.params and key not in self.owner:
            self.held.append(t.untyped_storage())
            self.owner[key] = unit
            self.bytes[unit] = self.bytes.get(unit, 0) + t.untyped_storage().nbytes()

    def hooks(self, unit: str) -> torch.autograd.graph.saved_tensors_hooks:
        self.bytes.setdefault(unit, 0)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.charge(unit, t) or t, lambda t: t)


def _random_config(rng: random.Random, family: str) -> ModelConfig:
    n_head = rng.choice([2, 4, 6])
    head_dim = rng.choice([8, 16, 24])
    vocab, positions, inner = rng.randint(50, 400), rng.choice([64, 128]), rng.randint(20, 300)
    if family == "gptj":
        return GPTJConfig(vocab_size=vocab, n_positions=positions, n_embd=n_head * head_dim, n_layer=2,
                          n_head=n_head, rotary_dim=2 * rng.randint(1, head_dim // 2), n_inner=inner)
    if family == "gemma3_text":  # both layer types, a window shorter than most sequences, two RoPE tables
        kinds = tuple(rng.sample(["sliding_attention", "full_attention"], 2))
        return FAMILIES[family](vocab_size=vocab, hidden_size=n_head * rng.choice([8, 12]), intermediate_size=inner,
                                num_hidden_layers=2, num_attention_heads=n_head,
                                num_key_value_heads=rng.choice([1, n_head]), head_dim=head_dim,
                                max_position_embeddings=positions, sliding_window=rng.randint(4, 24),
                                attention_layers=kinds, attention_bias=rng.random() < 0.5)
    # Grouped-query attention (one key/value head, or one per query head) and a head_dim of its own.
    sizes = dict(vocab_size=vocab, hidden_size=rng.choice([32, 48]), intermediate_size=inner, num_hidden_layers=2,
                 num_attention_heads=n_head, num_key_value_heads=rng.choice([1, n_head]), head_dim=head_dim,
                 max_position_embeddings=positions)
    # A mixture of experts: how many, how many a token takes, renormalised or not, their width
    # (intermediate_size but for Qwen3-MoE's own field); OLMoE's q norm spans hidden_size.
    if family == "qwen3_moe":
        sizes.update(num_experts=rng.choice([4, 8]), num_experts_per_tok=rng.choice([1, 2, 3]),
                     moe_intermediate_size=inner, norm_topk_prob=rng.choice([False, True]))
    elif family == "mixtral":
        sizes.update(num_local_experts=rng.choice([4, 8]), num_experts_per_tok=rng.choice([1, 2, 3]))
    elif family == "gpt_oss":  # both layer types, a window shorter than most sequences; sinks in every head
        sizes.update(num_local_experts=rng.choice([4, 8]), num_experts_per_tok=rng.choice([1, 2, 3]),
                     sliding_window=rng.randint(4, 24),
                     attention_layers=tuple(rng.sample(["sliding_attention", "full_attention"], 2)))
    elif family == "olmoe":
        sizes.update(num_experts=rng.choice([4, 8]), num_experts_per_tok=rng.choice([1, 2, 3]),
                     norm_topk_prob=rng.choice([False, True]), hidden_size=n_head * head_dim)
    return (GptOssConfig if family == "gpt_oss" else FAMILIES[family])(**sizes)  # gpt_oss: not yet registered


def _units(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.nn.Module, list[torch.nn.Module], torch.nn.Module]:
    torch.manual_seed(0)
    blocks = [build_unit(cfg, f"block.{i}", "cpu").to(dtype) for i in range(cfg.num_hidden_layers)]
    return build_unit(cfg, "embed", "cpu").to(dtype), blocks, build_unit(cfg, "head", "cpu").to(dtype)


# Every registered family's layout of a block (GPT-J, Llama, Qwen2's q/k/v biases, Qwen3's q/k norms, OLMo 2's
# norms after the sublayers and over whole projections, Phi-3's fused projections, Gemma 3's norms about
# 1 + weight and sliding windows, the mixtures of experts, OLMoE's q/k norms over whole projections), and
# gpt-oss's sinks and clamped experts with biases (built, not yet registered).
CASES = [(seed, dtype, family) for seed in range(2) for dtype in DTYPES for family in (*FAMILIES, "gpt_oss")]


@pytest.mark.parametrize("seed,dtype,family", CASES)
def test_saved_activation_formulas_match_the_layers(seed: int, dtype: str, family: str) -> None:
    """One unit at a time, nothing shared: the per-unit formulas against torch's own saved tensors."""
    rng = random.Random(seed)
    cfg = _random_config(rng, family)
    shape, es = cfg, DTYPES[dtype].itemsize
    batch, seq = rng.randint(1, 3), rng.randint(8, cfg.max_position_embeddings)
    embed, (block, _), head = _units(cfg, DTYPES[dtype])
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    h = torch.randn(batch, seq, cfg.hidden_size, dtype=DTYPES[dtype], requires_grad=True)
    measured = {}
    # The head's loss in vocabulary chunks, and in one chunk (it keeps its logits for the backward).
    kind = cfg.attention().layer_types()[0]
    for name, run in (("embed", lambda: embed(ids)), ("block", lambda: block(h)),
                      ("head", lambda: head(h, ids, vocab_chunk=7)), ("one chunk", lambda: head(h, ids))):
        saved = SavedStorages([embed, block, head])
        with saved.hooks(name):
            run()
        measured[name] = saved.bytes[name]
    expected = {"embed": embed_saved_bytes(shape, batch, seq),
                "block": block_saved_bytes(shape, batch, seq, es, layer_type=kind),
                "head": head_saved_bytes(shape, batch, seq, es, vocab_chunk=7),
                "one chunk": head_saved_bytes(shape, batch, seq, es)}
    for name in expected:
        assert expected[name] == measured[name], name  # measured: equal to the byte on every case


def _packed_positions(rng: random.Random, batch: int, seq: int) -> torch.Tensor:
    """Rows of packed examples: positions restarting at 0 where each example begins."""
    positions = torch.empty(batch, seq, dtype=torch.long)
    for row in range(batch):
        cut = rng.randint(1, seq - 1)
        positions[row] = torch.cat([torch.arange(cut), torch.arange(seq - cut)])
    return positions


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed,dtype,family", CASES)
def test_plan_rows_match_a_resident_forward_and_a_checkpoint_recompute(seed: int, dtype: str, family: str,
                                                                       packed: bool) -> None:
    """The whole model, storages shared across units as the runtime sees them (the fp32 rotary tables are
    one storage for every block; block j's saved input is block j-1's output). Packed rows: each block's
    own attention mask and rotary tables besides."""
    rng = random.Random(100 + seed)
    cfg = _random_config(rng, family)
    shape = cfg
    batch, seq = rng.randint(1, 3), rng.randint(8, cfg.max_position_embeddings)
    embed, blocks, head = _units(cfg, DTYPES[dtype])
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    args = (0, None, _packed_positions(rng, batch, seq)) if packed else ()
    saved = SavedStorages([embed, *blocks, head])
    with saved.hooks("embed"):
        x = embed(ids)
    inputs = []
    for i, block in enumerate(blocks):
        inputs.append(x)
        with saved.hooks(f"block.{i}"):
            x = block(x, *args)
    with saved.hooks("head"):
        head(x, ids, vocab_chunk=loss_vocab_chunk(shape, batch * seq))  # the runtime's chunk
    cfg_plan = PlanConfig.of(batch=batch, seq=seq, compute_dtype=dtype, packed=packed)
    rows = {r.unit: r for r in plan(shape, CS2, cfg_plan).rows}
    for unit, nbytes in saved.bytes.items():
        assert rows[unit].activation_bytes == nbytes, unit  # measured: equal to the byte on every case

    # Checkpoint: the block input is charged first; the recompute charges everything else it saves.
    rows = {r.unit: r for r in plan(shape, CS2, cfg_plan.replace(activations="checkpoint")).rows}
    last = f"block.{cfg.num_hidden_layers - 1}"
    recompute = SavedStorages([*blocks])
    recompute.charge("input", inputs[-1])
    with recompute.hooks(last):
        blocks[-1](inputs[-1].detach().requires_grad_(), *args)
    assert rows[last].activation_bytes == recompute.bytes["input"]
    assert rows[last].recompute_bytes == recompute.bytes[last]  # measured: equal to the byte on every case


# --- the charging walk, replayed on a real Ledger ---------------------------------------------------------------
def _replay(shape: GPTJConfig, cfg: PlanConfig) -> Ledger:
    """Allocate and free in the executor's order, with the executor's loop over the shared schedule and its
    charges (memory_model/schedule.py); the planner's moment-by-moment walk never sees this code."""
    ledger = Ledger(None)
    units = shape.unit_names()
    events = step_events(StepSpec(tuple(units), cfg.step.grad_accum, {u: shape.params().own(u) for u in units},
                                  cfg.step.update_chunk, offload_inputs=cfg.step.activations == "offload"))
    resident = resident_sets(events, cfg.step.prefetch)
    es, b, t = cfg.dtype_bytes, cfg.micro_batch, cfg.seq
    in_flight: dict[tuple, list[int]] = {}
    acts: dict[str, int] = {}
    flowing = offloading = None
    for k, e in enumerate(events):
        for r in resident[k]:
            if r not in in_flight:
                numel = block_input_numel(shape, b, t) if isinstance(r, BlockInput) else shape.params().own(r.unit)
                in_flight[r] = [ledger.allocate(c.category, r.unit, c.nbytes)
                                for c in resource_charges(r, numel, es, cfg.step.update_on)]
        kind = e.unit.split(".")[0]
        if e.phase == "forward":
            if kind == "block" and cfg.step.activations == "offload":  # on the device until copied out, at its end
                ledger.free(ledger.allocate("activations", e.unit, checkpoint_input_bytes(shape, b, t, es)))
                nbytes = 0
            elif kind == "block" and cfg.step.activations == "checkpoint":
                nbytes = checkpoint_input_bytes(shape, b, t, es)
            elif kind == "block":
                nbytes = block_saved_bytes(shape, b, t, es, rotary=es != 4 or e.unit == "block.0")
            else:
                nbytes = embed_saved_bytes(shape, b, t) if kind == "embed" else head_saved_bytes(shape, b, t, es)
            acts[e.unit] = ledger.allocate("activations", e.unit, nbytes)
        elif e.phase == "backward":
            extra = []
            if kind == "head":
                extra.append(ledger.allocate("workspace", "head", backward_workspace_bytes(shape, "head", b, t, es)))
            if kind == "block":  # autograd's buffers and the block's output, from the backward's start
                extra.append(ledger.allocate("workspace", e.unit, block_backward_transient_bytes(shape, b, t, es)))
            if kind == "block" and cfg.step.activations != "resident":
                extra.append(ledger.allocate("activations", e.unit, block_saved_bytes(shape, b, t, es)
                                             - checkpoint_input_bytes(shape, b, t, es)))
            grad = ledger.allocate("gradients", e.unit, shape.params().own(e.unit) * es)
            if offloading is not None:  # the previous unit's offload is waited for once this gradient exists
                ledger.free(offloading)
            offloading = grad
            for h in extra + ([flowing] if flowing else []):
                ledger.free(h)
            ledger.free(acts.pop(e.unit))
            flowing = None if kind == "embed" else ledger.allocate("workspace", e.unit, b * t * shape.n_embd * es)
            if kind == "embed":  # the first unit's backward waits for its own offload
                ledger.free(offloading)
                offloading = None
        else:
            for c in update_charges(e.resource, cfg.new_compute_bytes, cfg.step.update_on):
                ledger.free(ledger.allocate(c.category, e.unit, c.nbytes))
        if released_after(events, k):
            for h in in_flight.pop(e.resource):
                ledger.free(h)
        if e.phase == "backward" and e.stash is not None:  # its input back from the host leaves with it
            for h in in_flight.pop(e.stash):
                ledger.free(h)
    assert ledger.in_use == 0 and ledger.live() == 0
    return ledger


@settings(max_examples=40, deadline=None)
@given(n_layer=st.integers(1, 4), d=st.sampled_from([16, 32, 64]), vocab=st.integers(10, 300),
       micro=st.integers(1, 3), seq=st.integers(1, 64), accum=st.integers(1, 3), prefetch=st.integers(0, 3),
       activations=st.sampled_from(["resident", "checkpoint", "offload"]), dtype=st.sampled_from(["bf16", "fp32"]),
       update_on=st.sampled_from(["device", "host"]), chunk=st.sampled_from([100, 5_000, 16 * 2**20]))
def test_planned_peak_equals_a_ledger_replay(n_layer, d, vocab, micro, seq, accum, prefetch, activations, dtype,
                                             update_on, chunk) -> None:
    shape = GPTJConfig(vocab_size=vocab, n_positions=64, n_embd=d, n_layer=n_layer, n_head=4, rotary_dim=4)
    cfg = PlanConfig.of(batch=micro * accum, seq=seq, activations=activations, compute_dtype=dtype, prefetch=prefetch,
                        update_on=update_on, grad_accum=accum, update_chunk=chunk)
    ledger = _replay(shape, cfg)
    p = plan(shape, CS2, cfg)
    assert p.peak_device_bytes == ledger.peak == peak_device_bytes(shape, cfg)
    assert p.peak_breakdown == ledger.peak_breakdown


# --- the bar: GPT-J-6B on a CS-2 ---------------------------------------------------------------------------------
def test_gptj_6b_checkpoint_fits_in_3_gib_30x_below_the_baseline() -> None:
    assert GPTJ_6B.num_params() == 6_050_882_784 == PRESETS["gptj-6b"].num_params()
    assert GPTJ_6B.params().block() == 201_355_264
    cfg = PlanConfig.of(batch=1, seq=2048, activations="checkpoint", compute_dtype="bf16")
    p = plan(GPTJ_6B, CS2, cfg)
    assert p.baseline_bytes == 16 * 6_050_882_784 and round(p.baseline_bytes / GIB, 1) == 90.2
    assert p.peak_device_bytes <= 3 * GIB
    assert p.baseline_bytes / p.peak_device_bytes >= 30
    assert p.fits and sum(p.peak_breakdown.values()) == p.peak_device_bytes
    resident = plan(GPTJ_6B, CS2, cfg.replace(activations="resident"))
    assert p.peak_device_bytes < resident.peak_device_bytes < 10 * GIB and resident.fits
    assert resident.peak_breakdown["activations"] > 20 * p.peak_breakdown["activations"] / 3
    assert p.resident_baseline_bytes == resident.resident_baseline_bytes > p.baseline_bytes


def test_plan_json() -> None:
    p = plan(GPTJ_6B, CS2, PlanConfig.of(batch=1, seq=2048, activations="checkpoint"))
    raw = json.loads(json.dumps(p.to_json()))
    for key in ("params", "baseline_bytes", "resident_baseline_bytes", "peak_device_bytes", "peak_breakdown",
                "peak_at", "fits", "step_time_s", "tokens_per_s", "utilisation", "max_batch_seq", "rows", "config",
                "model", "device"):
        assert key in raw, key
    assert isinstance(raw["peak_device_bytes"], int) and set(raw["peak_breakdown"]) == set(CATEGORIES)
    assert len(raw["rows"]) == GPTJ_6B.n_layer + 2 and raw["rows"][1]["unit"] == "block.0"
    for row in raw["rows"]:
        for key in ("weight_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes", "h2d_bytes",
                    "d2h_bytes", "disk_read_bytes", "disk_write_bytes"):
            assert isinstance(row[key], int), key
    assert raw["device"] == "cs2" and raw["config"]["activations"] == "checkpoint"


def test_plan_table_renders() -> None:
    console = Console(record=True, width=220)
    console.print(plan(GPTJ_6B, CS2, PlanConfig.of(batch=1, seq=2048, activations="checkpoint")).table())
    text = console.export_text()
    assert "block.27" in text and "16 B/param baseline" in text and "fits" in text


# --- fit and search ------------------------------------------------------------------------------------------------
def test_does_not_fit_a_small_device_and_the_largest_batch_does() -> None:
    cfg = PlanConfig.of(batch=8, seq=2048, activations="resident")
    p = plan(GPTJ_6B, DEVICE_PRESETS["rtx4090"], cfg)
    assert not p.fits
    best, seq = p.max_batch_seq
    assert seq == 2048 and 1 <= best < 8
    assert plan(GPTJ_6B, DEVICE_PRESETS["rtx4090"], replace(cfg, batch=best)).fits
    rtx = DEVICE_PRESETS["rtx4090"]
    usable = rtx.memory_bytes - rtx.reserve_bytes - workspace_bytes(rtx.cuda_arch)  # less the context and cuBLAS's
    assert peak_device_bytes(GPTJ_6B, replace(cfg, batch=best + 1)) > usable
    short = p.max_seq
    assert 0 < short < 2048
    assert peak_device_bytes(GPTJ_6B, replace(cfg, seq=short)) <= usable
    assert peak_device_bytes(GPTJ_6B, replace(cfg, seq=short + 1)) > usable


def test_nothing_fits_a_tiny_device() -> None:
    tiny = replace(CS2, name="tiny", memory_bytes=2**20)
    p = plan(GPTJ_6B, tiny, PlanConfig.of(batch=1, seq=128))
    assert not p.fits and p.max_batch_seq == (0, 128) and p.max_seq == 0


def test_prefetch_and_update_place_change_the_peak_as_documented() -> None:
    base = PlanConfig.of(batch=1, seq=2048, activations="checkpoint")
    p0, p1, p2 = (plan(GPTJ_6B, CS2, base.replace(prefetch=n)) for n in (0, 1, 2))
    assert p0.peak_breakdown["weights"] < p1.peak_breakdown["weights"] < p2.peak_breakdown["weights"]
    update = plan(GPTJ_6B, CS2, base.replace(update_chunk=2**30))  # one chunk holds a whole unit
    assert update.peak_at[1] == "update" and update.peak_breakdown["optimizer"] > 0
    host = plan(GPTJ_6B, CS2, base.replace(update_chunk=2**30, update_on="host"))
    assert host.peak_breakdown["optimizer"] == 0 and host.peak_at[1] != "update"


# --- time ----------------------------------------------------------------------------------------------------------
def test_time_model_properties() -> None:
    base = PlanConfig.of(batch=4, seq=2048, activations="checkpoint")
    h100 = DEVICE_PRESETS["h100-sxm"]
    p1 = plan(GPTJ_6B, h100, base)
    p0 = plan(GPTJ_6B, h100, base.replace(prefetch=0))
    assert p0.step_time_s > p1.step_time_s > 0
    assert plan(GPTJ_6B, h100, base.replace(store="disk")).step_time_s > p1.step_time_s
    assert p1.tokens_per_s == 4 * 2048 / p1.step_time_s  # the same expression: measured equal
    assert 0 < p1.utilisation <= 1
    resident = plan(GPTJ_6B, h100, base.replace(activations="resident"))
    assert resident.step_time_s <= p1.step_time_s  # no recompute
    assert sum(r.backward_flops for r in p1.rows) > sum(r.backward_flops for r in resident.rows)
    slow_link = replace(h100, h2d=Link(1e9), d2h=Link(1e9))
    assert plan(GPTJ_6B, slow_link, base).bottleneck == "h2d"  # weights in twice, gradients out once
    fast_link = replace(h100, h2d=Link(1e15), d2h=Link(1e15), host_update_bw=1e15, flops={"bf16": 1e12, "fp32": 1e11})
    assert plan(GPTJ_6B, fast_link, base).bottleneck == "device compute"
    # A host update is the host's work, not the device's: a slow host bounds the step as "host compute".
    slow_host = replace(h100, host_update_bw=1e9)
    assert plan(GPTJ_6B, slow_host, base.replace(update_on="host")).bottleneck == "host compute"
    # The links are full duplex: gradients out do not wait for weights in.
    p = plan(GPTJ_6B, h100, base)
    assert p.step_time_s < p.resource_s["device compute"] + p.resource_s["h2d"] + p.resource_s["d2h"]
    # No prediction above the achievable share of the peak.
    assert p.utilisation <= h100.matmul_efficiency


def test_offloaded_block_inputs_leave_the_device_and_cross_the_pcie_links() -> None:
    """GPT-J-6B at 64 x 2048 on h100-sxm: offload keeps the block inputs in host memory. The peak (block.27's
    backward) falls by the inputs checkpoint keeps there beyond the two the backward holds: its own and the
    next one, prefetched. Each input crosses d2h during its forward and h2d before its backward, on the PCIe
    links, hidden behind the compute."""
    h100 = DEVICE_PRESETS["h100-sxm"]
    base = PlanConfig.of(batch=64, seq=2048, activations="checkpoint")
    kept, offloaded = (plan(GPTJ_6B, h100, base.replace(activations=a), limits=False)
                       for a in ("checkpoint", "offload"))
    one, blocks = checkpoint_input_bytes(GPTJ_6B, 64, 2048, 2), GPTJ_6B.n_layer  # 1 GiB each, 28 blocks
    assert kept.peak_at == offloaded.peak_at == ("block.27", "backward")
    assert kept.peak_device_bytes - offloaded.peak_device_bytes == (blocks - 2) * one == 26 * GIB
    assert offloaded.host_activation_bytes == blocks * one and kept.host_activation_bytes == 0
    for link in ("h2d", "d2h"):
        assert offloaded.link_bytes[link] - kept.link_bytes[link] == blocks * one
        seconds = blocks * h100.link_time(getattr(h100, link), one)  # 0.57 s at PCIe Gen5's 52.8 GB/s
        assert offloaded.resource_s[link] - kept.resource_s[link] == pytest.approx(seconds, rel=1e-12)
    assert [r.backward_flops for r in offloaded.rows] == [r.backward_flops for r in kept.rows]  # the same recompute
    assert offloaded.step_time_s == pytest.approx(kept.step_time_s, rel=1e-9)
    # On a link too slow to hide them the copies lengthen the step.
    slow = replace(h100, h2d=Link(4e9), d2h=Link(4e9))
    assert plan(GPTJ_6B, slow, base.replace(activations="offload"), limits=False).step_time_s > \
        plan(GPTJ_6B, slow, base, limits=False).step_time_s
    # The largest batch that fits grows with the inputs gone.
    assert plan(GPTJ_6B, h100, base.replace(activations="offload")).max_batch_seq[0] > \
        plan(GPTJ_6B, h100, base).max_batch_seq[0]


@pytest.mark.parametrize("name", [n for n in DEVICE_PRESETS if not n.startswith("cs")])
def test_no_gpu_plan_exceeds_the_best_published_training_mfu(name: str) -> None:
    """GPT-J-6B, 12 sequences x 16 micro-batches of 2048, resident activations, the update on the device: the
    matmuls alone would run at 77-81% of an A100's peak. The kernels beside them and the best published MFU of the
    class (MegaScale's 55.2%, catalogue.py) keep the plan at or below that MFU."""
    spec = DEVICE_PRESETS[name]
    p = plan(GPTJ_6B, spec, PlanConfig.of(batch=192, seq=2048, grad_accum=16, activations="resident"), limits=False)
    assert p.bottleneck == "device compute"
    assert p.utilisation <= spec.training_mfu <= 0.552
    matmuls_only = plan(GPTJ_6B, replace(spec, training_mfu=1.0, device_mem_bandwidth=1e30),
                        PlanConfig.of(batch=192, seq=2048, grad_accum=16, activations="resident"), limits=False)
    assert matmuls_only.utilisation > p.utilisation


def test_a_gpu_blocks_time_is_its_matmuls_attention_and_elementwise_bytes() -> None:
    """Below the MFU cap a preset's block forward is its matmuls and attention at their shares of the peak plus
    kernels.gpu_elementwise_bytes over the achievable HBM bandwidth; its backward twice the kernels' work."""
    h100 = DEVICE_PRESETS["h100-sxm"]
    shape, cfg = PRESETS["gptj-350m"], PlanConfig.of(batch=1, seq=512)
    block = {r.unit: r for r in plan(shape, replace(h100, training_mfu=1e-9 + 1e-12), cfg).rows}["block.0"]
    uncapped = {r.unit: r for r in plan(shape, replace(h100, training_mfu=1.0), cfg).rows}["block.0"]
    peak, hbm = h100.flops["bf16"], h100.device_mem_bandwidth * h100.bandwidth_efficiency
    attn = attention_flops(shape, 1, 512)
    expected = ((block.forward_flops - attn) / (peak * h100.matmul_efficiency)
                + attn / (peak * h100.attention_efficiency)
                + gpu_elementwise_bytes(shape, "block.0", "forward", 1, 512, 2) / hbm)
    assert uncapped.forward_s == pytest.approx(expected, rel=1e-12)
    assert uncapped.backward_s == pytest.approx(2 * (expected - gpu_elementwise_bytes(
        shape, "block.0", "forward", 1, 512, 2) / hbm) + gpu_elementwise_bytes(shape, "block.0", "backward", 1, 512,
                                                                                 2) / hbm, rel=1e-12)
    # With a (made-up) cap far below, the forward takes its model FLOPs at the capped rate.
    assert block.forward_s == pytest.approx(block.forward_flops / (peak * (1e-9 + 1e-12)), rel=1e-12)


def test_compute_bound_step_time_is_the_flops() -> None:
    """With free I/O the step is the FLOPs over the rate, recompute included, plus the AdamW sweep."""
    free = DeviceSpec(name="free-io", memory_bytes=10**12, h2d=Link(1e18), d2h=Link(1e18),
                      flops={"bf16": 1e12, "fp32": 1e12}, device_mem_bandwidth=1e18, host_ram_bytes=10**13,
                      disk_read_bw=1e18, disk_write_bw=1e18, host_update_bw=1e18)
    cfg = PlanConfig.of(batch=1, seq=512, activations="checkpoint")
    p = plan(GPTJ_6B, free, cfg)
    flops = sum(r.forward_flops + r.backward_flops for r in p.rows)
    # Measured relative difference 8.3e-9 in both: the step's non-flop terms (rel 1e-3 was 1e5x that); 10x margin.
    assert p.step_time_s == pytest.approx(flops / 1e12, rel=8e-8)
    assert p.utilisation == pytest.approx(p.model_flops / flops, rel=8e-8)


def test_kernel_costs_add_their_counted_seconds_to_the_matmuls() -> None:
    """With kernel costs, attention leaves the matmul rate and each unit pays its counted elements."""
    from memory_model.kernels import KernelCosts, attention_flops, elementwise_width
    free = DeviceSpec(name="free-io", memory_bytes=10**12, h2d=Link(1e18), d2h=Link(1e18),
                      flops={"bf16": 1e12, "fp32": 1e12}, device_mem_bandwidth=1e18, host_ram_bytes=10**13,
                      disk_read_bw=1e18, disk_write_bw=1e18, host_update_bw=1e18)
    costs = KernelCosts(attention_forward_flops=1e11, attention_backward_flops=5e10, elementwise_forward_s=1e-9,
                        elementwise_backward_s=2e-9, logits_forward_s=3e-9, logits_backward_s=4e-9,
                        embedding_backward_s=5e-10, gradient_fold_bytes_per_s=1e18, compute_cast_bytes_per_s=1e9,
                        event_s=0.0, step_s=0.0, disk_event_s=0.0, disk_step_s=0.0, page_cache_bytes_per_s=1e18,
                        flush_s=0.0)
    shape, cfg = GPTJConfig.preset("gptj-350m"), PlanConfig.of(batch=1, seq=512)
    base, costed = plan(shape, free, cfg), plan(shape, replace(free, kernels={"bf16": costs}), cfg)
    # The update casts each parameter's new master to bf16: 4 B read and 2 B written, at the measured rate.
    update_s = {r.unit: r for r in costed.rows}["block.0"].update_s
    assert update_s == pytest.approx({r.unit: r for r in base.rows}["block.0"].update_s
                                     + shape.params().own("block.0") * 6 / 1e9, rel=1e-12)
    n, attn = 512, attention_flops(shape, 1, 512)
    block = {r.unit: r for r in costed.rows}["block.0"]
    mm = (block.forward_flops - attn) / 1e12
    # Measured relative differences 0 and 1.9e-16 (the terms summed in another order); 1e-15 is 5x the latter.
    assert block.forward_s == pytest.approx(mm + attn / 1e11 + 1e-9 * n * elementwise_width(shape), rel=1e-15)
    assert block.backward_s == pytest.approx(2 * mm + 2 * attn / 5e10 + 2e-9 * n * elementwise_width(shape),
                                             rel=1e-15)
    head = {r.unit: r for r in costed.rows}["head"]
    assert head.forward_s == head.forward_flops / 1e12 + 3e-9 * n * shape.vocab_size  # measured equal
    embed = {r.unit: r for r in costed.rows}["embed"]
    # Without measured costs the embedding's backward is its dense gradient's bytes over HBM (the preset model).
    base_embed = {r.unit: r for r in base.rows}["embed"].backward_s
    assert base_embed == gpu_elementwise_bytes(shape, "embed", "backward", 1, 512, 2) / 1e18
    assert embed.backward_s > base_embed
    assert costed.step_time_s > base.step_time_s
    assert plan(shape, replace(free, kernels={"fp32": costs}), cfg).step_time_s == base.step_time_s  # per dtype
    # Attention's cost per token and query head adds to each block's forward and backward.
    tokens = replace(costs, attention_forward_token_s=1e-7, attention_backward_token_s=3e-7)
    per_token = {r.unit: r for r in plan(shape, replace(free, kernels={"bf16": tokens}), cfg).rows}["block.0"]
    heads = n * shape.num_attention_heads
    assert per_token.forward_s == pytest.approx(block.forward_s + 1e-7 * heads, rel=1e-12)
    assert per_token.backward_s == pytest.approx(block.backward_s + 3e-7 * heads, rel=1e-12)


def test_fixed_costs_add_once_per_event_and_once_per_step() -> None:
    """A measured fixed cost per forward, backward and update event, and one per step: on a device whose
    I/O is free, the step grows by exactly that many of them."""
    from memory_model.kernels import KernelCosts
    free = DeviceSpec(name="free-io", memory_bytes=10**12, h2d=Link(1e18), d2h=Link(1e18),
                      flops={"bf16": 1e12, "fp32": 1e12}, device_mem_bandwidth=1e18, host_ram_bytes=10**13,
                      disk_read_bw=1e18, disk_write_bw=1e18, host_update_bw=1e18)
    costs = dict(attention_forward_flops=1e11, attention_backward_flops=5e10, elementwise_forward_s=1e-9,
                 elementwise_backward_s=2e-9, logits_forward_s=3e-9, logits_backward_s=4e-9,
                 embedding_backward_s=5e-10, gradient_fold_bytes_per_s=1e18, compute_cast_bytes_per_s=1e9)
    shape, cfg = GPTJConfig.preset("gptj-debug"), PlanConfig.of(batch=2, seq=64, grad_accum=2)
    free_io = dict(page_cache_bytes_per_s=1e18, flush_s=0.0)
    base = plan(shape, replace(free, kernels={"bf16": KernelCosts(**costs, event_s=0.0, step_s=0.0, disk_event_s=0.0,
                                                                   disk_step_s=0.0, **free_io)}), cfg)
    fixed = plan(shape, replace(free, kernels={"bf16": KernelCosts(**costs, event_s=1e-3, step_s=2e-3, disk_event_s=5.0,
                                                                    disk_step_s=7.0, **free_io)}), cfg)
    units = shape.unit_names()
    events = step_events(StepSpec(tuple(units), 2, {u: shape.params().own(u) for u in units}, cfg.step.update_chunk,
                                  fused=cfg.fused))
    assert len(events) > 2 * 2 * len(units)  # two micro-batches' forwards and backwards, and the updates
    assert fixed.step_time_s == pytest.approx(base.step_time_s + len(events) * 1e-3 + 2e-3, rel=1e-12)
    # The disk tier pays its own fixed costs (measured on it), on its own (fused) step.
    disk = cfg.replace(store="disk")
    disk_events = step_events(planned_spec(shape, disk))
    assert plan(shape, replace(free, kernels=fixed.device.kernels), disk).step_time_s == pytest.approx(
        plan(shape, replace(free, kernels=base.device.kernels), disk).step_time_s + len(disk_events) * 5.0 + 7.0,
        rel=1e-12)


def test_each_state_file_waits_on_the_disks_queue() -> None:
    """A disk-tier update's state file costs its measured `state_file_s` after its unit's last write-back, on the
    disk's queue. With every other cost free, the update after the backward waits for each unit's file in turn;
    the RAM tier writes none."""
    from memory_model.kernels import KernelCosts
    free = DeviceSpec(name="free-io", memory_bytes=10**12, h2d=Link(1e18), d2h=Link(1e18),
                      flops={"fp32": 1e18}, device_mem_bandwidth=1e18, host_ram_bytes=10**13,
                      disk_read_bw=1e18, disk_write_bw=1e18, host_update_bw=1e18)
    costs = KernelCosts(attention_forward_flops=1e18, attention_backward_flops=1e18, elementwise_forward_s=0.0,
                        elementwise_backward_s=0.0, logits_forward_s=0.0, logits_backward_s=0.0,
                        embedding_backward_s=0.0, gradient_fold_bytes_per_s=1e18, compute_cast_bytes_per_s=1e18,
                        event_s=0.0, step_s=0.0, disk_event_s=0.0, disk_step_s=0.0, page_cache_bytes_per_s=1e18,
                        flush_s=0.0, state_file_s=1.0)
    shape, device = GPTJConfig.preset("gptj-debug"), replace(free, kernels={"fp32": costs})
    cfg = PlanConfig.of(batch=1, seq=64, compute_dtype="fp32", update_timing="after-backward", update_chunk=4096)
    disk = plan(shape, device, cfg.replace(store="disk"), limits=False)
    assert max(shape.params().own(u) for u in shape.unit_names()) > 4096  # units of several chunks, one file each
    assert disk.step_time_s == pytest.approx(len(shape.unit_names()), rel=1e-9)
    assert plan(shape, device, cfg.replace(store="ram"), limits=False).step_time_s < 1e-6


def _free_cpu(**costs: float) -> DeviceSpec:
    """A cpu device (host and device one memory) on which compute, bytes and fixed costs are free (1e30 a second,
    0 s), but for `costs`, fields of its bf16 and fp32 KernelCosts."""
    from memory_model.kernels import KernelCosts
    free = 1e30
    kernels = KernelCosts(**{"attention_forward_flops": free, "attention_backward_flops": free,
                             "elementwise_forward_s": 0.0, "elementwise_backward_s": 0.0, "logits_forward_s": 0.0,
                             "logits_backward_s": 0.0, "embedding_backward_s": 0.0,
                             "gradient_fold_bytes_per_s": free, "compute_cast_bytes_per_s": free, "event_s": 0.0,
                             "step_s": 0.0, "disk_event_s": 0.0, "disk_step_s": 0.0,
                             "page_cache_bytes_per_s": free, "flush_s": 0.0, **costs})
    return DeviceSpec(name="local", memory_bytes=10**12, h2d=Link(free), d2h=Link(free),
                      flops={"bf16": free, "fp32": free}, device_mem_bandwidth=free, host_ram_bytes=10**13,
                      disk_read_bw=free, disk_write_bw=free, host_update_bw=free, same_memory=True,
                      kernels={"bf16": kernels, "fp32": kernels})


def test_a_cpu_disk_step_pays_the_page_cache_for_what_it_writes_and_its_gradient_files_alone() -> None:
    """On a cpu device the cores that compute copy what a disk-tier step writes, and the gradient files it reads
    back through the page cache; the state files are read past it (streamer.store.direct), with no copy. The
    step takes those bytes at the page cache's rate on top of the same step's with free copies."""
    shape, cfg = GPTJConfig.preset("gptj-debug"), PlanConfig.of(batch=1, seq=64, compute_dtype="fp32", store="disk")
    device, uncopied = _free_cpu(page_cache_bytes_per_s=1e9), _free_cpu()

    def copies_s(timing: str) -> tuple[float, dict[str, int]]:
        """The step's seconds beyond those of the same step with free copies, and its disk bytes."""
        step = cfg.replace(update_timing=timing)
        planned = plan(shape, device, step, limits=False)
        return planned.step_time_s - plan(shape, uncopied, step, limits=False).step_time_s, planned.link_bytes

    fused_s, fused = copies_s("fused")
    assert fused["disk_read"] > 0  # the state files are read, and cost no copy
    assert fused_s == pytest.approx(fused["disk_write"] / 1e9, rel=1e-9)
    after_s, after = copies_s("after-backward")
    gradients = 4 * shape.num_params()  # each unit's fp32 gradient, written by its backward, read by its update
    assert after_s == pytest.approx((after["disk_write"] + gradients) / 1e9, rel=1e-9)
    assert after["disk_read"] > gradients


def test_the_opt_in_precisions_pay_their_measured_elementwise_work() -> None:
    """Where measured, each int8 moment is dequantized at its chunk's load and quantized for its write-back on
    the I/O worker, and a bf16 master is rounded in the update: on a device whose compute and bytes are free
    and whose fixed costs are zero, the step is that work (the I/O worker's loads and write-backs are serial)."""
    from memory_model.kernels import KernelCosts
    free = DeviceSpec(name="free-io", memory_bytes=10**12, h2d=Link(1e18), d2h=Link(1e18),
                      flops={"bf16": 1e18, "fp32": 1e18}, device_mem_bandwidth=1e18, host_ram_bytes=10**13,
                      disk_read_bw=1e18, disk_write_bw=1e18, host_update_bw=1e18)
    costs = KernelCosts(attention_forward_flops=1e18, attention_backward_flops=1e18, elementwise_forward_s=0.0,
                        elementwise_backward_s=0.0, logits_forward_s=0.0, logits_backward_s=0.0,
                        embedding_backward_s=0.0, gradient_fold_bytes_per_s=1e18, compute_cast_bytes_per_s=1e18,
                        event_s=0.0, step_s=0.0, disk_event_s=0.0, disk_step_s=0.0, page_cache_bytes_per_s=1e18,
                        flush_s=0.0, quantize_s=3e-9, dequantize_s=2e-9, round_s=5e-9)
    shape = GPTJConfig.preset("gptj-debug")
    device, params = replace(free, kernels={"bf16": costs}), shape.num_params()
    fp32 = PlanConfig.of(batch=1, seq=64, store="disk", update_timing="fused")
    assert plan(shape, device, fp32).step_time_s < 1e-6  # nothing measured is spent by the fp32 state
    int8 = fp32.replace(moment_dtype="int8", update_chunk=4096)
    assert plan(shape, device, int8).step_time_s == pytest.approx(2 * params * (3e-9 + 2e-9), rel=1e-3)
    bf16 = fp32.replace(master_dtype="bf16")
    assert plan(shape, device, bf16).step_time_s == pytest.approx(params * 5e-9, rel=1e-3)


@pytest.mark.parametrize("timing,flushes", [("fused", 2), ("after-backward", 4 + 2 + 2)])
def test_a_disk_tier_commit_pays_each_flush_its_fixed_costs_do_not_hold(timing, flushes) -> None:
    """Each unit's state file is sealed with three flushes (data, trailer, folder) on the I/O thread, and the
    trainer's thread waits for the manifest's two: the disk tier's fixed costs, measured on a fused step, hold
    those. A journaled step also flushes its gradient files and its journal: on a device whose compute, bytes
    and fixed costs are free, the step is those flushes end to end."""
    from memory_model.timing import commit_flushes, unmeasured_flushes
    shape = GPTJConfig.preset("gptj-debug")  # 4 units
    cfg = PlanConfig.of(batch=2, seq=64, store="disk", update_timing=timing)
    assert commit_flushes(shape, cfg) == flushes and unmeasured_flushes(shape, cfg) == flushes - 2
    flushing = _free_cpu(flush_s=1e-3)
    assert plan(shape, flushing, cfg).step_time_s == pytest.approx((flushes - 2) * 1e-3, abs=1e-12)
    assert plan(shape, flushing, cfg.replace(store="ram", update_timing="auto")).step_time_s < 1e-9  # no files


def test_a_cpu_device_folds_gradients_on_the_compute_thread() -> None:
    """The runtime folds RAM-tier gradients inline on a cpu device: that time is no longer hidden."""
    slow_fold = DeviceSpec(name="local", memory_bytes=10**12, h2d=Link(1e18), d2h=Link(1e18),
                           flops={"bf16": 1e12, "fp32": 1e12}, device_mem_bandwidth=1e18, host_ram_bytes=10**13,
                           disk_read_bw=1e18, disk_write_bw=1e18, host_update_bw=1e9)
    shape, cfg = GPTJConfig.preset("gptj-350m"), PlanConfig.of(batch=1, seq=512)
    overlapped, inline = plan(shape, slow_fold, cfg), plan(shape, replace(slow_fold, same_memory=True), cfg)
    serial = sum(r.forward_s + r.backward_s + r.update_s + r.offload_s for r in inline.rows)
    assert sum(r.offload_s for r in inline.rows) > 0.1  # 10 B/param at 1 GB/s: about 0.35 s for 350M
    # nothing overlaps the fold any more; measured relative difference 1.95e-15 (summation order); 5x margin
    assert inline.step_time_s == pytest.approx(serial, rel=1e-14)
    assert overlapped.step_time_s < serial


def test_same_memory_device_moves_bytes_without_link_time() -> None:
    local = replace(CS2, name="local", same_memory=True)
    cfg = PlanConfig.of(batch=1, seq=256)
    shared, linked = plan(GPTJ_6B, local, cfg), plan(GPTJ_6B, CS2, cfg)
    assert [r.h2d_bytes for r in shared.rows] == [r.h2d_bytes for r in linked.rows]
    assert all(r.h2d_bytes > 0 for r in shared.rows)
    assert sum(r.load_s for r in shared.rows) == 0 < sum(r.load_s for r in linked.rows)


@pytest.mark.parametrize("timing", ["after-backward", "fused"])
def test_bytes_over_each_link_per_step(timing: str) -> None:
    cfg = PlanConfig.of(batch=2, seq=128, grad_accum=2, store="disk", update_timing=timing)
    p = plan(GPTJ_6B, CS2, cfg)
    block = p.rows[5]
    # weights in for the forward and the backward of each micro-batch, plus the state in for the update
    assert block.h2d_bytes == 2 * 2 * block.weight_bytes + block.params * 16
    assert block.d2h_bytes == 2 * block.gradient_bytes + block.params * 12  # no compute copy on the disk tier
    # From disk: the fp32 master for each of the 4 weights loads (cast to bf16 on the host), the accumulator
    # re-read in micro-batch 1, the moments; the update after the backward also reads master and gradient,
    # a fused one takes its gradient from the backward and its master from the backward's load.
    fused = timing == "fused"
    assert block.disk_read_bytes == block.params * (4 * 4 + 4 + 8 + (0 if fused else 4 + 4))
    # the accumulator written in each micro-batch (a fused step keeps the last one), the new master and moments
    assert block.disk_write_bytes == (1 if fused else 2) * 4 * block.params + block.params * 12


# --- validation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(batch=0), dict(seq=-1), dict(activations="swap"), dict(prefetch=-1),
                                 dict(compute_dtype="fp16"), dict(update_on="disk"), dict(store="nvme"),
                                 dict(batch=3, grad_accum=2), dict(update_chunk=0), dict(devices=0),
                                 dict(update_timing="fused"), dict(update_timing="fused", store="disk", devices=2)])
def test_plan_config_rejects(bad: dict) -> None:
    with pytest.raises(ValueError):
        PlanConfig.of(**{"batch": 2, "seq": 16, **bad})


def test_unit_params_add_up_to_the_model_and_the_plan_checks_its_context() -> None:
    for cfg in PRESETS.values():
        assert sum(cfg.params().own(u) for u in cfg.unit_names()) == cfg.num_params()
    with pytest.raises(ValueError):
        plan(GPTJ_6B, CS2, PlanConfig.of(batch=1, seq=4096))


def test_devices_split_the_batch_and_pay_for_the_all_reduce() -> None:
    """Data parallel as the runtime does it: each device takes batch/devices rows, applies the whole update
    to its own copy, and all-reduces every unit's fp32 gradient over the interconnect (a ring on GPUs; on
    SwarmX the reduce happens in the network and costs hop latency only)."""
    h100 = DEVICE_PRESETS["h100-sxm"]
    one = plan(GPTJ_6B, h100, PlanConfig.of(batch=8, seq=1024, activations="checkpoint"))
    four = plan(GPTJ_6B, h100, PlanConfig.of(batch=8, seq=1024, activations="checkpoint", devices=4))
    assert four.peak_breakdown["activations"] < one.peak_breakdown["activations"]
    assert sum(r.update_s for r in four.rows) == sum(r.update_s for r in one.rows)  # measured equal
    ring = 2 * 3 / 4 * 4 * GPTJ_6B.num_params()  # fp32 gradients, ring all-reduce over 4 devices
    extra_offload = sum(r.offload_s for r in four.rows) - sum(r.offload_s for r in one.rows)
    assert extra_offload >= ring / h100.interconnect.bandwidth_bytes_per_s
    cs_one = plan(GPTJ_6B, CS2, PlanConfig.of(batch=8, seq=1024, activations="checkpoint"))
    cs_four = plan(GPTJ_6B, CS2, PlanConfig.of(batch=8, seq=1024, activations="checkpoint", devices=4))
    levels = 2  # ceil(log4 4) + 1
    assert sum(r.offload_s for r in cs_four.rows) - sum(r.offload_s for r in cs_one.rows) == pytest.approx(
        levels * CS2.interconnect.latency_s * len(GPTJ_6B.unit_names()))
    # Weight streaming is I/O-bound at small batches: more devices only add the all-reduce. Where compute
    # dominates (64 x 2048 on an H100), splitting the batch scales.
    assert cs_four.tokens_per_s < cs_one.tokens_per_s
    h100 = [plan(GPTJ_6B, device_spec("h100-sxm"), PlanConfig.of(batch=64, seq=2048, activations="checkpoint",
                                                             devices=n)).tokens_per_s for n in (1, 2, 4)]
    assert h100[0] < h100[1] < h100[2]

def test_memoryx_is_shared_by_the_systems_and_swarmx_reduces_at_its_own_rate() -> None:
    """MemoryX serves every system through SwarmX, which broadcasts one weight stream and sums the gradients into
    one: its I/O carries one stream however many systems train, so a slower MemoryX slows one system and sixteen
    alike. SwarmX's reduce bandwidth bounds the gradients of several systems, not of one. A host whose devices
    each stream their own store (a ring) splits its I/O among them."""
    cfg = PlanConfig.of(batch=8, seq=1024, activations="checkpoint", update_on="host")
    sixteen = replace(cfg, batch=16 * 8, devices=16)

    def curve(device: DeviceSpec) -> tuple:
        one, many = plan(GPTJ_6B, device, cfg, limits=False), plan(GPTJ_6B, device, sixteen, limits=False)
        return one, many, many.tokens_per_s / (16 * one.tokens_per_s)

    cs3 = device_spec("cs3")
    one, many, efficiency = curve(cs3)
    assert cs3.host_io_bytes_per_s == cs3.h2d.bandwidth_bytes_per_s == cs3.interconnect.bandwidth_bytes_per_s
    # One stream each: the same bytes at the same rate; sixteen systems wait for the tree's levels on every load.
    assert one.link_bytes == many.link_bytes
    hops = (many.resource_s["h2d"] - one.resource_s["h2d"]) / (tree_levels(16) * cs3.interconnect.latency_s)
    assert hops == pytest.approx(2 * len(GPTJ_6B.unit_names()) - 1)  # every load (the head stays for its backward)
    rate = cs3.h2d.bandwidth_bytes_per_s * cs3.bandwidth_efficiency
    slow_memoryx = curve(with_sets(cs3, ["host_io_bytes_per_s=30e9"]))  # a fifth of the line rate
    for base, slow in ((one, slow_memoryx[0]), (many, slow_memoryx[1])):
        assert slow.resource_s["h2d"] - base.resource_s["h2d"] == pytest.approx(4 * base.link_bytes["h2d"] / rate)
    slow_swarmx = curve(with_sets(cs3, ["interconnect_bytes_per_s=30e9"]))
    assert slow_swarmx[0].step_time_s == one.step_time_s  # one system: no tree
    assert slow_swarmx[1].resource_s["d2h"] - many.resource_s["d2h"] == pytest.approx(4 * many.link_bytes["d2h"] / rate)
    assert slow_swarmx[2] < efficiency < 1
    # Eight GPUs of one server, each streaming its own store: each gets an eighth of the host's I/O.
    h100 = with_sets(device_spec("h100-sxm"), ["host_io_bytes_per_s=100e9"])
    eight = plan(GPTJ_6B, h100, replace(cfg, batch=64, devices=8), limits=False)
    alone = plan(GPTJ_6B, h100, cfg, limits=False)
    link, shared = h100.h2d.bandwidth_bytes_per_s, 100e9 / 8
    assert eight.link_bytes["h2d"] == alone.link_bytes["h2d"]
    assert eight.resource_s["h2d"] - alone.resource_s["h2d"] == pytest.approx(
        alone.link_bytes["h2d"] * (1 / shared - 1 / link) / h100.bandwidth_efficiency)


def test_the_planner_runs_without_torch() -> None:
    """memory_model (schedule, planner) and the model arithmetic it uses (layers.config and the family configs)
    import no torch."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from layers import GPTJConfig\n"
            "from memory_model import PlanConfig, device_spec, plan\n"
            "p = plan(GPTJConfig.preset('gptj-debug'), device_spec('cs2'), PlanConfig.of(batch=1, seq=16))\n"
            "print(p.peak_device_bytes, sorted(m for m in sys.modules if m.startswith(('layers', 'streamer'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = ast.literal_eval(done.stdout.split(" ", 1)[1])
    assert loaded and all(m == "layers" or m.startswith("layers.") for m in loaded)  # nothing of streamer
    assert not [m for m in loaded if m.endswith((".units", ".model", ".block"))]  # no family's torch side


@pytest.mark.parametrize("store,timing", [("ram", "overlapped"), ("disk", "fused")])
def test_a_host_update_overlapped_with_the_backward_hides_behind_it(store, timing) -> None:
    """MemoryX, LoHan, ZeRO-Offload: a unit's host AdamW starts once its gradient is folded, on the host's
    cores, while the device computes the backward of the units before it; fused into the backward (the
    runtime's, on the disk tier) or overlapped with it (planned only). A fast disk keeps the disk tier's
    state traffic from bounding the step."""
    h100 = replace(DEVICE_PRESETS["h100-sxm"], disk_read_bw=1e12, disk_write_bw=1e12)
    cfg = PlanConfig.of(batch=64, seq=2048, activations="checkpoint", update_on="host", store=store,
                        update_timing="after-backward")
    after = plan(GPTJ_6B, h100, cfg)
    overlapped = plan(GPTJ_6B, h100, cfg.replace(update_timing=timing))
    assert overlapped.step_time_s < after.step_time_s
    assert overlapped.resource_s["host compute"] == pytest.approx(after.resource_s["host compute"])
    # The update's seconds are the host's: the device computes the same either way.
    assert overlapped.resource_s["device compute"] == after.resource_s["device compute"]
    assert after.step_time_s >= after.resource_s["device compute"] + sum(r.update_s for r in after.rows) * 0.99


def test_bf16_moments_the_reserve_and_per_rank_stores_in_the_accounting() -> None:
    h100 = DEVICE_PRESETS["h100-sxm"]
    cfg = PlanConfig.of(batch=8, seq=2048, activations="checkpoint", update_on="host")
    fp32, bf16 = plan(GPTJ_6B, h100, cfg), plan(GPTJ_6B, h100, cfg.replace(moment_dtype="bf16"))
    assert fp32.host_store_bytes - bf16.host_store_bytes == 4 * GPTJ_6B.num_params()  # two moments, 2 B less each
    assert sum(r.update_s for r in bf16.rows) == pytest.approx(sum(r.update_s for r in fp32.rows) * 20 / 28)
    # int8: a byte per moment and an fp32 scale per block of 256 (the store's own rule, units.stored_bytes).
    int8 = plan(GPTJ_6B, h100, cfg.replace(moment_dtype="int8"))
    n = GPTJ_6B.num_params()
    assert fp32.host_store_bytes - int8.host_store_bytes == 2 * (4 * n - stored_bytes("int8", n))
    assert sum(r.optimizer_bytes for r in int8.rows) == sum(
        4 * r.params + 2 * stored_bytes("int8", r.params) for r in int8.rows)
    assert sum(r.update_s for r in int8.rows) == pytest.approx(sum(r.update_s for r in fp32.rows) * 16.0625 / 28,
                                                               rel=1e-3)
    # A bf16 master: 2 B less, and the bf16 compute weights are the master (no 2 B copy beside it).
    master = plan(GPTJ_6B, h100, cfg.replace(master_dtype="bf16"))
    assert fp32.host_store_bytes - master.host_store_bytes == 4 * n
    assert sum(r.optimizer_bytes for r in master.rows) == 10 * n
    assert sum(r.update_s for r in master.rows) == pytest.approx(sum(r.update_s for r in fp32.rows) * 24 / 28)
    # The CUDA context is not the model's: a peak (as the CUDA allocator counts it) that leaves less than it free
    # does not fit.
    tight = replace(h100, memory_bytes=fp32.allocated_peak_bytes + h100.reserve_bytes - 1)
    assert not plan(GPTJ_6B, tight, cfg).fits
    assert plan(GPTJ_6B, replace(tight, memory_bytes=tight.memory_bytes + 1), cfg).fits
    # Each data-parallel rank holds its own store; one MemoryX serves every CS-2.
    eight = plan(GPTJ_6B, h100, replace(cfg, devices=8))
    assert eight.host_stores == 8 and plan(GPTJ_6B, CS2, replace(cfg, devices=8)).host_stores == 1
    assert not plan(GPTJ_6B, replace(h100, host_ram_bytes=4 * fp32.host_store_bytes), replace(cfg, devices=8)).host_fits
