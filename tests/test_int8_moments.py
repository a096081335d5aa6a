"""int8 Adam moments (`--moment-dtype int8`): block-wise quantized as 8-bit Adam stores them, held against
torchao's AdamW8bit, and every store path: RAM and disk tiers, the update on the device and on the host, and the
planner's bytes. The fused update's rollback and clipping: tests/test_fused_update.py; a kill and resume:
tests/test_reliability.py."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_same_tensors, strided_sequences, train_debug
from layers import GPTJConfig
from memory_model.planner import step_disk_bytes
from memory_model.shapes import PlanConfig
from memory_model.units import QUANT_BLOCK, Precision, stored_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.errors import ConfigError, StoreError
from streamer.runtime.optim import OptimizerConfig, adamw_chunk
from streamer.store.quant import decode, dynamic_map, encode, restored, stored
from streamer.store.spec import StoreSpec

CFG = GPTJConfig.preset("gptj-debug")
# Several chunks per unit, each whole blocks; lr large enough for the moments to matter between steps.
INT8 = TrainerConfig.of(dtype="fp32", update_chunk=20 * QUANT_BLOCK, lr=3e-3, moment_dtype="int8",
                        max_grad_norm=0, nonfinite="skip")



# --- the quantizer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [QUANT_BLOCK, 5 * QUANT_BLOCK + 37, 11])
def test_a_round_trip_is_within_half_a_code_step_of_each_blocks_absmax(signed, numel):
    """Each value comes back as the nearest code of its block's map: at most half the gap between the two
    codes around it, times the block's absmax (below the signed map's lowest code, the distance to it). The
    stored bytes are `stored_bytes`: one per value and an fp32 scale per block, a partial last block included."""
    g = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=g) * torch.logspace(-6, 0, numel)  # every decade of the dynamic map
    values = values if signed else values.square()
    raw = encode(values, signed, torch.empty(stored_bytes("int8", numel), dtype=torch.uint8))
    back = decode(raw, signed, torch.empty(numel))
    qmap = torch.tensor(dynamic_map(signed))
    for first in range(0, numel, QUANT_BLOCK):
        block, got = values[first:first + QUANT_BLOCK], back[first:first + QUANT_BLOCK]
        scale = block.abs().max()
        normed = block / scale
        upper = torch.bucketize(normed, qmap).clamp(1, 255)
        half_step = (qmap[upper] - qmap[upper - 1]) / 2
        # The signed map ends at -0.993, not -1 (bitsandbytes' and torchao's too): below it, the distance to it.
        half_step = torch.where(normed < qmap[0], qmap[0] - normed, half_step)
        rounding = 2 * torch.finfo(torch.float32).eps * scale  # of the fp32 value, code x scale
        assert torch.all((got - block).abs() <= half_step * scale + rounding)
    assert len(set(qmap.tolist())) == 256 and qmap.max() == 1.0 and (qmap.min() < -0.99 if signed else qmap.min() == 0)
    # An all-zero block is stored as zeros.
    zeros = encode(torch.zeros(numel), signed, torch.empty_like(raw))
    assert torch.equal(decode(zeros, signed, torch.ones(numel)), torch.zeros(numel))


@pytest.mark.parametrize("signed", [True, False])
def test_each_value_takes_its_nearest_code_halfway_rounding_up(signed):
    """The codes are a binary search's over the midpoints between neighbouring codes (torch.bucketize, a value on
    a midpoint rounding up, as torchao's quantize_8bit_with_qmap), at every midpoint, a step either side of it,
    every code and random values of every decade. Each block holds a 1.0, so its scale is exactly 1."""
    qmap = torch.tensor(dynamic_map(signed))
    mids = (qmap[:-1] + qmap[1:]) / 2
    probes = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)),
                        qmap, torch.tensor([0.0, -0.0]), torch.rand(4000) * torch.logspace(-9, 0, 4000)])
    probes = torch.cat([probes, -probes]) if signed else probes.abs()
    probes = torch.cat([probes, torch.zeros(-len(probes) % (QUANT_BLOCK - 1))]).view(-1, QUANT_BLOCK - 1)
    values = torch.cat([torch.ones(len(probes), 1), probes], dim=1).reshape(-1)
    raw = encode(values, signed, torch.empty(stored_bytes("int8", values.numel()), dtype=torch.uint8))
    codes = raw.view(-1, 4 + QUANT_BLOCK)[:, 4:].reshape(-1)
    assert torch.equal(codes.long(), torch.bucketize(values, mids, right=True))


def test_the_codes_are_torchaos_and_its_adamw8bit_takes_the_same_steps(monkeypatch):
    """torchao's AdamW8bit on one tensor (8192 values: it quantizes tensors of 4096 or more in blocks of 256, as
    the store quantizes every chunk), against the store's update: moments dequantized, torch's fused AdamW,
    quantized back. The codes of the same values are torchao's, bit for bit, and over 10 steps so are the
    moments' codes; weights and scales agree within fp32 rounding of the two AdamW formulations."""
    from torchao.optim import AdamW8bit
    from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap, scale_tensor

    for signed in (True, False):
        assert dynamic_map(signed) == create_dynamic_map(signed)
    values = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    normed, _ = scale_tensor(values, QUANT_BLOCK)
    theirs = quantize_8bit_with_qmap(normed, torch.tensor(create_dynamic_map(True)))
    ours = encode(values, True, torch.empty(stored_bytes("int8", 8192), dtype=torch.uint8))
    assert torch.equal(ours.view(-1, 4 + QUANT_BLOCK)[:, 4:].reshape(-1), theirs)

    # Its step function eagerly, the ops it compiles (a compile takes ~20 s on this CPU).
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    opt = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    start = torch.randn(8192, generator=g)
    param = torch.nn.Parameter(start.clone())
    reference = AdamW8bit([param], lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                        weight_decay=opt.weight_decay)
    spec = StoreSpec(CFG, Precision("bf16", moments="int8"), chunk=8192)
    master = start.clone()
    moments = {k: stored(spec, k, torch.zeros(8192)) for k in ("exp_avg", "exp_avg_sq")}
    for step in range(1, 11):
        grad = torch.randn(8192, generator=g) * (1 + step)
        param.grad = grad.clone()
        reference.step()
        state = {"master": master, "grad": grad.clone()}
        for kind, raw in moments.items():
            state[kind] = torch.empty(8192)
            restored(spec, kind, raw, state[kind])
        adamw_chunk(state, 0, 8192, opt, step, opt.lr, 1.0)
        moments = {k: stored(spec, k, state[k]) for k in moments}
        # Each step moves a weight by about lr (1e-2); the two differ by fp32 rounding of the two AdamW
        # formulations (torch's fused kernel, torchao's lerp), measured at most 1.4e-6 after 10 steps.
        assert torch.allclose(master, param.detach(), rtol=0, atol=1e-5), step
        for kind, raw in moments.items():
            theirs = reference.state[param][kind]
            records = raw.view(-1, 4 + QUANT_BLOCK)
            scales, codes = records[:, :4].contiguous().view(torch.float32).flatten(), records[:, 4:].reshape(-1)
            # Measured over these 10 steps: every code the same, the scales within 1.8e-7 (2 ulp) of theirs.
            assert torch.equal(codes, theirs.codes), (step, kind)
            assert torch.allclose(scales, theirs.scale, rtol=1e-6, atol=0), (step, kind)
    assert not torch.equal(master, start)


def test_int8_moments_track_fp32_adamw_on_held_out_data():
    """A tiny model learning strided token sequences, the same data and seed: the held-out loss with int8 moments
    stays within the issue's 1% of exact fp32 AdamW at every evaluation (measured at most 0.71%, at step 40,
    while the loss falls from 5.5 to 2.95)."""
    held_out, curves = strided_sequences(8, 99), {}
    for moments in ("fp32", "int8"):
        tc = INT8.replace(store="ram", moment_dtype=moments, max_grad_norm=1.0)
        with StreamingTrainer(CFG, tc) as trainer:
            curves[moments] = []
            for step in range(40):
                trainer.step(strided_sequences(4, step))
                if step % 10 == 9:
                    curves[moments].append(trainer.evaluate(held_out))
    assert curves["fp32"][-1] < 3.0
    assert all(abs(b / a - 1) < 0.01 for a, b in zip(curves["fp32"], curves["int8"], strict=True)), curves


# --- the store -------------------------------------------------------------------------------------------------
def test_int8_moments_train_alike_in_ram_on_disk_and_with_the_update_on_the_host(tmp_path):
    """The same bits whichever tier holds the moments (the disk tier's update fused into the backward) and
    wherever the update runs."""
    ram = train_debug(tmp_path / "ram", INT8.replace(store="ram"))
    disk = train_debug(tmp_path / "disk", INT8.replace(store="disk"))
    host = train_debug(tmp_path / "host", INT8.replace(store="ram", update_on="host"))
    after = train_debug(tmp_path / "after", INT8.replace(store="disk", update_timing="after-backward"))
    disk_host = train_debug(tmp_path / "disk-host", INT8.replace(store="disk", update_on="host"))
    for other in (disk, host, after, disk_host):
        assert other[0] == ram[0]
        assert_same_tensors(other[1], ram[1])
    fp32 = train_debug(tmp_path / "fp32", INT8.replace(store="ram", moment_dtype="fp32"))
    assert fp32[0][:2] == ram[0][:2]  # the first update starts from zero moments, exact in int8
    assert fp32[0] != ram[0]


@pytest.mark.parametrize("timing", ["fused", "after-backward"])
def test_the_store_moves_the_planners_bytes_and_a_third_of_fp32s(tmp_path, timing):
    """Disk bytes per step, counted by the store's files, equal the planner's to the byte; per parameter the
    moments cost 2 x (1 + 4/256) B instead of 8."""
    tc = INT8.replace(store="disk", dtype="bf16", update_timing=timing)
    plan = PlanConfig.of(batch=2, seq=16, compute_dtype="bf16", update_chunk=tc.step.update_chunk, store="disk",
                         update_timing=timing, moment_dtype="int8")
    moved = train_debug(tmp_path / "run", tc, steps=2)[2]
    assert moved == step_disk_bytes(CFG, plan)
    n, head = CFG.num_params(), CFG.params().own("head")
    if timing == "fused":
        scales = sum(2 * 4 * -(-c // QUANT_BLOCK) for u in CFG.unit_names()
                     for c in _chunk_counts(CFG.params().own(u), tc.step.update_chunk))
        assert moved == ((4 + 4 + 2) * n - 4 * head + scales, (4 + 2) * n + scales)


def _chunk_counts(numel: int, chunk: int) -> list[int]:
    return [min(chunk, numel - s) for s in range(0, numel, chunk)]


def test_the_store_size_is_what_it_writes(tmp_path):
    """StoreSpec.host_bytes, the figure `streamer train` checks free RAM and disk against, is the files of a
    committed step plus one more generation; the RAM tier's slabs are the same sizes."""
    tc = INT8.replace(store="disk", update_timing="after-backward")  # its gradients have files too
    train_debug(tmp_path / "disk", tc, steps=1)
    slabs = {p.name: p.stat().st_size for p in (tmp_path / "disk" / "slabs").iterdir()}
    ram, disk = tc.store_spec(CFG).host_bytes()
    states = sum(size for name, size in slabs.items() if name.endswith(".state"))
    assert ram == 0 and disk == sum(slabs.values()) + states
    in_ram = tc.replace(store="ram").store_spec(CFG)
    numels = {u: CFG.params().own(u) for u in CFG.unit_names()}
    expected = sum(4 * n + 4 * n + 2 * stored_bytes("int8", n) for n in numels.values())  # master, grad, moments
    assert in_ram.host_bytes()[0] == expected


def test_an_update_chunk_that_splits_a_block_is_refused_in_one_line():
    for make in (lambda: TrainerConfig.of(moment_dtype="int8", update_chunk=5000),
                 lambda: PlanConfig.of(batch=1, seq=8, moment_dtype="int8", update_chunk=5000)):
        with pytest.raises((ConfigError, ValueError), match=r"update.chunk must be a multiple of 256 with "
                                                            r"--moment-dtype int8"):
            make()
    with pytest.raises(StoreError, match="multiple of 256"):
        StoreSpec(CFG, Precision("bf16", moments="int8"), chunk=5000)


# --- data parallel ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_replicated_and_sharded_train_as_one_process(tmp_path):
    """Replicated, each rank quantizes the whole unit as one process does: equal within the gloo sum's fp32
    rounding, carried through the quantized moments (fp32 moments: 4.3e-6, tests/test_sharded_data_parallel.py).
    Sharded, each rank's slice carries its own blocks and scales, so the blocks are not one process's: equal
    within the quantization, less than one step's movement (lr). The sharded run resumes from its rank stores."""
    from test_distributed import _max_diff, run_data_parallel, single_process

    tc = INT8.replace(store="disk", update_chunk=40 * QUANT_BLOCK, max_grad_norm=1.0, lr=1e-3)
    reference = single_process(tmp_path, 3, tc)
    # Measured: 1.7e-5 replicated, 3.8e-4 sharded (weights); losses 2.4e-8 and 1.2e-5 apart.
    for mode, phases, weights, losses in (("replicated", [("new", 3)], 5e-5, 1e-6),
                                          ("sharded", [("new", 2), ("open", 1)], 1e-3, 1e-4)):
        ranks = run_data_parallel(tmp_path / mode, phases, tc.replace(data_parallel=mode))
        assert _max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
        assert _max_diff(ranks[0]["state"], reference["state"]) <= weights
        assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=losses)


# --- streamer plan ---------------------------------------------------------------------------------------------
def test_plan_shows_the_host_ram_and_disk_each_moment_dtype_needs(capsys):
    """`streamer plan` prints the store's RAM and disk as `streamer train` lays it out (StoreSpec.host_bytes, the
    figure train checks before it writes anything), and the disk bytes of a step, for every moment dtype."""
    from streamer.cli.main import main

    needs = {}
    for moments in ("fp32", "bf16", "int8"):
        for store in ("ram", "disk"):
            assert main(["plan", "--model", "gptj-debug", "--store", store, "--moment-dtype", moments, "--json"]) == 0
            out = json.loads(capsys.readouterr().out)
            tc = TrainerConfig.of(dtype="bf16", store=store, moment_dtype=moments)
            assert (out["store_ram_bytes"], out["store_disk_bytes"]) == tc.store_spec(CFG).host_bytes(
                every_unit_twice=True)  # a fused step (disk) or a save (RAM) keeps every unit's previous files
            needs[moments, store] = out["store_ram_bytes"] + out["store_disk_bytes"], out["disk_write_bytes_per_step"]
    for store in ("ram", "disk"):
        assert needs["int8", store][0] < needs["bf16", store][0] < needs["fp32", store][0]
    assert needs["int8", "disk"][1] < needs["bf16", "disk"][1] < needs["fp32", "disk"][1]
    assert main(["plan", "--model", "gptj-debug", "--moment-dtype", "int8"]) == 0
    assert "host store per process: " in capsys.readouterr().out


def test_a_disk_too_small_for_bf16_moments_is_told_int8_fits(tmp_path):
    """`streamer train`'s refusal names the least drastic change that fits: int8 moments after bf16's."""
    from streamer.resources import HostNeed, shortfall
    from streamer.run import resolve

    cfg = resolve({"model": "gptj-1.3b", "store": "disk", "update_timing": "after-backward",
                   "run_dir": str(tmp_path / "r")})
    model_cfg = cfg.model_config()
    need = {m: HostNeed.of(model_cfg, cfg.trainer.replace(moment_dtype=m), 1, 1).disk for m in ("bf16", "int8")}
    between = (need["bf16"] + need["int8"]) // 2
    assert "what would fit: --moment-dtype int8" in shortfall(cfg, model_cfg, 64 * 2**30, between, tmp_path)


def test_lora_trains_alike_with_int8_moments(tmp_path):
    """A LoRA run's store holds the frozen base alone (no moments); its adapters keep torch's AdamW on the device,
    whatever --moment-dtype says, so the setting is accepted and changes nothing."""
    lora = INT8.replace(lora_rank=4, store="disk")
    int8 = train_debug(tmp_path / "int8", lora, steps=3)
    fp32 = train_debug(tmp_path / "fp32", lora.replace(moment_dtype="fp32"), steps=3)
    assert int8[0] == fp32[0] and int8[2] == fp32[2]
    assert_same_tensors(int8[1], fp32[1])
