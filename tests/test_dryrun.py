"""The dry run (real schedule on meta) matches the real run's ledger and the analytic planner."""
from __future__ import annotations

import json

import pytest
import torch

from layers import GPTJConfig
from memory_model import PlanConfig, device_spec, plan
from memory_model.planner import step_disk_bytes
from streamer import Placement, StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run


def test_gptj_6b_checkpointed_fits_3_gib_and_planner_agrees():
    cfg = GPTJConfig.preset("gptj-6b")
    ledger = dry_run(cfg, TrainerConfig.of(activations="checkpoint", dtype="bf16"), batch=1, seq=2048)
    assert ledger.peak <= 3 * 2**30
    assert 16 * cfg.num_params() / ledger.peak >= 30  # vs the 16 B/param baseline (90.2 GiB)
    predicted = plan(cfg, device_spec("cs2"), PlanConfig.of(batch=1, seq=2048, activations="checkpoint"))
    # Measured: the planner is 8,200 bytes below the dry run's 1,966,953,352 (4.2e-6 relative).
    assert predicted.peak_device_bytes == pytest.approx(ledger.peak, rel=3e-5)


@pytest.mark.parametrize("n_embd,n_head,n_layer,rotary,inner,batch,seq,activations,dtype,prefetch", [
    (64, 4, 2, 8, None, 2, 32, "resident", "bf16", 1),
    (96, 3, 3, 16, 200, 3, 48, "checkpoint", "bf16", 2),
    (128, 8, 4, 4, None, 1, 64, "resident", "fp32", 0),
    (80, 5, 2, 16, 320, 4, 16, "checkpoint", "fp32", 1),
])
def test_planner_matches_dry_run(n_embd, n_head, n_layer, rotary, inner, batch, seq, activations, dtype, prefetch):
    cfg = GPTJConfig(vocab_size=512, n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     rotary_dim=rotary, n_inner=inner)
    tc = TrainerConfig.of(activations=activations, dtype=dtype, prefetch=prefetch, update_chunk=20_000)
    ledger = dry_run(cfg, tc, batch, seq)
    predicted = plan(cfg, device_spec("h100-sxm"), PlanConfig.of(
        batch=batch, seq=seq, activations=activations, compute_dtype=dtype, prefetch=prefetch, update_chunk=20_000))
    # Measured: at most 768 bytes apart (1.03e-3 relative, the 64-wide bf16 case), planner below the dry run.
    assert predicted.peak_device_bytes == pytest.approx(ledger.peak, rel=0.01)


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_dry_run_equals_the_real_runs_ledger(tmp_path, master):
    """RAM tier: with a bf16 master the bf16 compute weights are the master, so no update writes new ones."""
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(dtype="bf16", update_chunk=20_000, master_dtype=master)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 48)))
        real = trainer.ledger.peak, trainer.ledger.peak_breakdown
    dry = dry_run(cfg, tc, 2, 48)
    # Streamed state is identical; meta's LayerNorm keeps more (B, T, 1) fp32 statistics than the CPU
    # kernel: measured 1,152 bytes of 738,820 (1.56e-3 relative), hence 1.5% on the peak.
    for category in ("weights", "gradients", "optimizer", "workspace"):
        assert dry.peak_breakdown[category] == real[1][category]
    assert dry.peak == pytest.approx(real[0], rel=0.015)
    planned = plan(cfg, device_spec("h100-sxm"), PlanConfig.of(batch=2, seq=48, compute_dtype="bf16",
                                                           update_chunk=20_000, master_dtype=master))
    assert planned.peak_device_bytes == pytest.approx(dry.peak, rel=0.015)


@pytest.mark.parametrize("dtype,moments,master", [("bf16", "fp32", "fp32"), ("fp32", "fp32", "fp32"),
                                                  ("bf16", "int8", "fp32"), ("bf16", "int8", "bf16"),
                                                  ("fp32", "fp32", "bf16")])
def test_disk_tier_fused_step_dry_run_real_run_and_planner_agree(tmp_path, dtype, moments, master):
    """The disk tier's fused step (weights cast from the fp32 master, the update's master from the backward's
    load, no new compute weights): the same streamed charges in the real run, the dry run and the plan. int8
    moments cross to the device dequantized, a bf16 master widened: the same 12 B/param of optimizer state."""
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(dtype=dtype, update_chunk=20_480, store="disk", max_grad_norm=0, moment_dtype=moments,
                          master_dtype=master)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 48)))
        assert trainer.fused and trainer.clipped_redos == 0
        real = trainer.ledger.peak_breakdown
    dry = dry_run(cfg, tc, 2, 48)
    planned = plan(cfg, device_spec("h100-sxm"), PlanConfig.of(batch=2, seq=48, compute_dtype=dtype,
                                                           update_chunk=20_480, store="disk", moment_dtype=moments,
                                                           master_dtype=master))
    for category in ("weights", "gradients", "optimizer", "workspace"):
        assert dry.peak_breakdown[category] == real[category]
    assert planned.peak_device_bytes == pytest.approx(dry.peak, rel=0.015)


@pytest.mark.parametrize("settings", [
    dict(dtype="bf16", store="ram", grad_accum=2, update_chunk=20_000),
    dict(dtype="fp32", store="disk", update_chunk=20_000),  # fused: each update takes its load's master
    dict(dtype="bf16", store="disk", grad_accum=2, update_timing="after-backward", update_chunk=30_000),
    dict(dtype="bf16", update_on="host", prefetch=2, update_chunk=50_000),  # fused on the host
    dict(dtype="fp32", grad_accum=2, lora_rank=4),  # a frozen base: no update events
    dict(dtype="bf16", store="disk", grad_accum=2, activations="offload", prefetch=2),  # block inputs on the host
    dict(dtype="bf16", store="disk", moment_dtype="int8", update_chunk=20_480),  # quantized moments, whole blocks
    dict(dtype="bf16", store="ram", master_dtype="bf16"),  # the compute weights are the master: no copy
    dict(dtype="fp32", store="disk", master_dtype="bf16", update_chunk=20_000),  # loads widen the bf16 master
    dict(dtype="bf16", store=Placement("ram", "disk", "disk"), grad_accum=2),  # RAM weights, state on disk: fused
])
def test_the_trainer_and_the_planner_describe_one_step(settings):
    """One run's settings give the trainer and the planner the same step description, hence one event list."""
    from memory_model.planner import planned_spec
    from memory_model.schedule import step_events
    from streamer.run import RunConfig

    run = RunConfig.of(dict(model="gptj-debug", batch=4, seq=16, **settings))
    shape, step = run.model_config(), run.trainer.step
    trainer = StreamingTrainer(shape, run.trainer.replace(device="meta"))  # as the dry run builds it
    planned = planned_spec(shape, run.plan_config())
    assert trainer.step_spec(step.grad_accum, trainer.fused) == planned
    assert step_events(planned) == step_events(trainer.step_spec(step.grad_accum, trainer.fused))
    disk = step.store.state == "disk"
    assert planned.fused == (disk and step.update_timing == "auto" and not run.trainer.lora.rank)
    assert planned.master_from_weights == (step.store.tier == "disk")  # a load reads no master beside a RAM copy
    trainer.close()


@pytest.fixture(scope="module")
def calibrated_here(tmp_path_factory: pytest.TempPathFactory):
    """A folder whose runs/ caches one real calibration of `local` (small probe sizes), for `--target local`."""
    import streamer.calibration.calibrate as calibrate
    from test_devices import TINY

    here = tmp_path_factory.mktemp("calibrated")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "DEFAULT_SIZES", TINY)
        patch.chdir(here)
        yield here


@pytest.mark.parametrize("activations", ["resident", "checkpoint"])
@pytest.mark.parametrize("update_on", ["device", "host"])
@pytest.mark.parametrize("store", ["ram", "disk"])
@pytest.mark.parametrize("target", ["cs2", "h100-sxm", "local"])
def test_plan_dry_run_through_the_cli(capsys, calibrated_here, target, store, update_on, activations):
    """Every target kind (wafer, GPU, this cpu) x store x update place x activations: the dry run runs (an
    update on the host once crashed it) and its ledger agrees with the analytic plan."""
    from test_cli import run_cli

    rc, out, err = run_cli(capsys, "plan", "--model", "gptj-debug", "--target", target, "--store", store,
                           "--update-on", update_on, "--activations", activations, "--batch", 2, "--seq", 32,
                           "--dry-run", "--json")
    assert rc == 0 and err == "", err
    planned = json.loads(out)
    assert planned["config"]["update_on"] == update_on and planned["config"]["store"] == store
    assert planned["dry_run_peak_device_bytes"] == sum(planned["dry_run_peak_breakdown"].values()) > 0
    # As test_planner_matches_dry_run: the planner within 1% of the runtime's ledger.
    assert planned["peak_device_bytes"] == pytest.approx(planned["dry_run_peak_device_bytes"], rel=0.01)


@pytest.mark.parametrize("target,store,update_on", [("h100-sxm", "ram", "device"), ("cs2", "disk", "host")])
def test_plan_dry_run_of_offloaded_activations_through_the_cli(capsys, target, store, update_on):
    """`--activations offload` in `streamer plan --dry-run`: the dry run's ledger equals the plan to the byte in
    fp32, and the plan holds the inputs in host memory."""
    from test_cli import run_cli

    rc, out, err = run_cli(capsys, "plan", "--model", "gptj-debug", "--target", target, "--store", store,
                           "--update-on", update_on, "--activations", "offload", "--dtype", "fp32", "--batch", 2,
                           "--seq", 32, "--dry-run", "--json")
    assert rc == 0 and err == "", err
    planned = json.loads(out)
    assert planned["config"]["activations"] == "offload"
    assert planned["peak_device_bytes"] == planned["dry_run_peak_device_bytes"]
    assert planned["host_activation_bytes"] == 4 * 2 * 32 * 32 * 4  # 4 blocks' (2, 32, 32) fp32 inputs


def test_plan_dry_run_refuses_a_step_it_cannot_run_in_one_line(capsys):
    from test_cli import fails

    err = fails(capsys, "plan", "--model", "gptj-debug", "--store", "ram", "--update-timing", "fused", "--dry-run")
    assert "--update-timing" in err and "--store disk" in err


@pytest.mark.parametrize("dtype,activations,lora_rank", [
    ("bf16", "resident", 0), ("fp32", "resident", 0), ("fp32", "checkpoint", 0), ("fp32", "resident", 4),
    ("bf16", "checkpoint", 4),
])
def test_packed_rows_real_run_dry_run_and_planner_agree(tmp_path, dtype, activations, lora_rank):
    """Rows of packed examples: each block also saves its attention mask (a compute-dtype bias) and its rows'
    rotary tables. The planner charges them to the byte; the dry run routes the masked attention as the CPU does."""
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(dtype=dtype, activations=activations, lora_rank=lora_rank, update_chunk=20_000)
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    positions = torch.cat([torch.arange(20), torch.arange(28)]).expand(2, 48)  # two examples a row
    peaks = {}
    for packed in (False, True):
        with StreamingTrainer(cfg, tc, store_dir=tmp_path / f"run{packed}") as trainer:
            trainer.step(ids, positions=positions if packed else None)
            real = trainer.ledger.peak
        dry = dry_run(cfg, tc, 2, 48, packed=packed).peak
        planned = plan(cfg, device_spec("h100-sxm"), PlanConfig.of(
            batch=2, seq=48, compute_dtype=dtype, activations=activations, update_chunk=20_000, packed=packed,
            lora=tc.lora)).peak_device_bytes
        assert planned == real  # measured: equal to the byte, packed or not
        # Meta's LayerNorm keeps more fp32 statistics than the CPU kernel: measured 1,152 bytes (bf16 resident)
        # and 384 bytes (bf16 LoRA checkpoint) above the real run, packed or not; 0 in fp32.
        assert dry - real == (1152 if (dtype, lora_rank) == ("bf16", 0) else 384 if dtype == "bf16" else 0)
        peaks[packed] = real
    if (dtype, activations) != ("bf16", "checkpoint"):  # (there the head's backward is the peak either way)
        assert peaks[True] > peaks[False]


@pytest.mark.parametrize("dtype,timing", [("bf16", "auto"), ("fp32", "auto"), ("bf16", "after-backward")])
def test_a_mixed_placement_is_planned_as_it_runs(tmp_path, dtype, timing):
    """Compute weights in RAM and the state on disk: the state's tier makes the update fused, the compute
    weights' makes each load read the RAM copy (in bf16; fp32 weights are the master, read from disk) and
    each update write a new one. The plan of the trainer's own step settings is the real run's ledger peak,
    and its disk bytes what the store's files move, to the byte; neither is a whole tier's."""
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(dtype=dtype, store=Placement("ram", "disk", "disk"), update_chunk=20_000,
                          update_timing=timing, max_grad_norm=0)
    pc = tc.plan_config(1, 8)  # a step short enough that an update chunk is its peak
    assert pc.step is tc.step and pc.fused == (timing == "auto")
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        for _ in range(2):
            trainer.step(torch.randint(0, cfg.vocab_size, (1, 8)))
            assert trainer.step_bytes == step_disk_bytes(cfg, pc)
        assert trainer.fused == pc.fused and trainer.clipped_redos == 0
        real = trainer.ledger.peak
    device = device_spec("h100-sxm")
    assert plan(cfg, device, pc).peak_device_bytes == real
    disk = pc.replace(store="disk")
    if dtype == "bf16":  # the loads read no master, and each update chunk writes new compute weights on the device
        assert step_disk_bytes(cfg, pc)[0] < step_disk_bytes(cfg, disk)[0]
        assert real == plan(cfg, device, disk).peak_device_bytes + 20_000 * 2
    else:  # the master is the compute weights: the loads read it from disk as the disk tier's do
        assert step_disk_bytes(cfg, pc) == step_disk_bytes(cfg, disk)
        assert real == plan(cfg, device, disk).peak_device_bytes


def test_gradients_alone_on_disk_are_planned_as_they_run(tmp_path):
    """The gradient accumulator alone in files, the state in RAM (so the update follows the backward): each
    micro-batch's gradient is written, read back by the next one and by the update. The plan's disk bytes are
    what the store's files move and its peak the ledger's, to the byte."""
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(dtype="bf16", store=Placement("ram", "ram", "disk"), grad_accum=2, update_chunk=20_000)
    pc = tc.plan_config(2, 16)
    assert not pc.fused
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 16)))
        assert trainer.step_bytes == step_disk_bytes(cfg, pc) == (8 * cfg.num_params(), 8 * cfg.num_params())
        assert trainer.ledger.peak == plan(cfg, device_spec("h100-sxm"), pc).peak_device_bytes


@pytest.mark.parametrize("settings", [dict(dtype="fp32", activations="offload"), dict(dtype="fp32"),
                                      dict(dtype="fp32", activations="checkpoint", prefetch=2)])
def test_a_norm_pass_on_meta_charges_the_planned_peak(settings):
    """A norm-first step's norm pass (forward and backward, no update, nothing stored): the runtime's ledger
    on meta peaks at the planner's norm-pass peak to the byte, and no higher than the update after the backward."""
    from memory_model.planner import norm_pass_peak, peak_device_bytes
    from memory_model.schedule import norm_pass_spec, step_events
    from streamer.calibration.dryrun import FlashAttentionOnMeta
    from streamer.runtime.step import MicroBatch, StepContext

    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(store="disk", update_chunk=20_000, **settings)
    trainer = StreamingTrainer(cfg, tc.replace(device="meta"))
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    ctx = StepContext([MicroBatch(ids, ids)], 1, 0.0, 64.0, norm_pass=True)
    with FlashAttentionOnMeta():
        trainer.executor.run(step_events(norm_pass_spec(trainer.step_spec(1, fused=True))), ctx)
    trainer.close()
    pc = PlanConfig.of(batch=2, seq=32, store="disk", update_chunk=20_000, compute_dtype="fp32",
                       **{k: v for k, v in settings.items() if k != "dtype"})
    assert trainer.ledger.peak == norm_pass_peak(cfg, pc)
    assert norm_pass_peak(cfg, pc) <= peak_device_bytes(cfg, pc.replace(update_timing="after-backward"))


def test_plan_dry_run_of_a_step_that_clips_norm_first(capsys):
    """`streamer plan --dry-run` also runs a step that clips on the schedule the plan chose for it: norm-first,
    whose peak (its norm pass's or its fused step's) the plan states to the byte in fp32."""
    from test_cli import run_cli

    rc, out, err = run_cli(capsys, "plan", "--model", "gptj-debug", "--target", "h100-sxm", "--store", "disk",
                           "--dtype", "fp32", "--activations", "offload", "--batch", 2, "--seq", 32,
                           "--clipped-steps", "norm-first", "--dry-run", "--json")
    assert rc == 0 and err == "", err
    planned = json.loads(out)
    assert planned["clipped_schedule"] == "norm-first"
    assert planned["dry_run_clipped_peak_device_bytes"] == planned["clipped_steps"]["norm-first"]["peak_bytes"]
    assert set(planned["clipped_steps"]) == {"norm-first", "after-backward"}


@pytest.mark.parametrize("family,lora_rank,prefetch,dtype", [
    ("llama", 0, 1, "fp32"), ("llama", 4, 2, "bf16"), ("gemma3_text", 4, 1, "fp32"), ("qwen2", 0, 2, "bf16"),
])
def test_a_rollouts_generation_plan_ledger_and_dry_run_agree_to_the_byte(family, lora_rank, prefetch, dtype):
    """GRPO's generation of a prompt (its KV cache on the device, the units streamed in each pass or resident):
    `rollout_plan`'s peak and makeup = the real generation's ledger = the dry run's on meta, to the byte, full
    fine-tuning and LoRA, Llama, Gemma 3 and Qwen2."""
    import dataclasses

    from layers import FAMILIES
    from memory_model.rollout import rollout_plan
    from streamer.calibration.dryrun import dry_run_generation
    from streamer.generate import Sampling, generate

    cfg = dataclasses.replace(FAMILIES[family].example(), max_position_embeddings=64)
    tc = TrainerConfig.of(dtype=dtype, lora_rank=lora_rank, prefetch=prefetch, method="grpo", num_generations=4,
                          max_completion_length=6, top_p=0.9)
    planned = rollout_plan(cfg, device_spec("h100-sxm"), tc.plan_config(8, 16))  # 2 prompts of 10 + 6 tokens
    prompt = torch.randint(1, cfg.vocab_size, (4, 10), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(cfg, tc) as trainer:
        for resident, way in ((False, planned.streamed), (True, planned.resident)):
            trainer.ledger.reset_peak()
            generate(trainer, prompt, Sampling(max_new_tokens=6, temperature=1.0, top_p=0.9), resident=resident)
            dry = dry_run_generation(cfg, tc, 4, 10, resident)
            assert (way.peak_bytes, way.peak_breakdown) == (trainer.ledger.peak, trainer.ledger.peak_breakdown) \
                == (dry.peak, dry.peak_breakdown)
            assert dry.live() == trainer.ledger.live() == (3 if lora_rank else 0)  # the adapters alone are left
    assert planned.resident.peak_bytes > planned.streamed.peak_bytes


def test_plan_dry_run_walks_a_grpo_rollouts_generation_through_the_cli(capsys):
    """`streamer plan --method grpo --dry-run` runs a prompt's generation on meta both ways and prints its peaks
    beside the plan's, equal to the byte."""
    from test_cli import run_cli

    flags = ["plan", "--model", "llama-debug", "--target", "h100-sxm", "--method", "grpo", "--batch", 8,
             "--num-generations", 4, "--max-completion-length", 6, "--seq", 16, "--dtype", "fp32", "--lora-rank", 4,
             "--dry-run"]
    rc, out, err = run_cli(capsys, *flags, "--json")
    assert rc == 0 and err == "", err
    planned = json.loads(out)
    for way in ("streamed", "resident"):
        assert planned["dry_run_generation"][way] == {"peak_device_bytes": planned["rollout"][way]["peak_bytes"],
                                                      "peak_breakdown": planned["rollout"][way]["peak_breakdown"]}
    rc, out, err = run_cli(capsys, *flags)
    assert rc == 0, err
    assert "dry run of a prompt's generation: streamed peak" in " ".join(out.split())
