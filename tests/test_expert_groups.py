"""A mixture-of-experts block whose experts load in groups (--expert-group-size): as the planner prices and
chooses it, and as the runtime trains it (the same weights as whole blocks, at the planned peak)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from layers import FAMILIES, PRESETS, MixtralConfig, ModelConfig
from memory_model import DEVICE_PRESETS, PlanConfig, format_size, plan
from memory_model.devices import with_sets
from memory_model.expert_groups import expert_group, grouped_block_numel
from memory_model.planner import PLAN_MARGIN_BYTES, fewest_expert_groups, peak_device_bytes, step_disk_bytes
from memory_model.settings import SettingError
from memory_model.shapes import block_backward_transient_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.advice import alternatives, planned_peak
from streamer.calibration.dryrun import dry_run
from streamer.errors import ConfigError
from streamer.generate import Sampling, generate
from streamer.run import resolve
from streamer.run_dir import RunDir
from tests.test_cli import fails, run_cli, tiny_args

MIXTRAL = PRESETS["mixtral-8x7b"]


def _h100(memory: float):
    return with_sets(DEVICE_PRESETS["h100-sxm"], [f"memory_bytes={memory:.0f}"])


def test_a_grouped_block_holds_all_but_its_experts_and_one_group():
    cfg = PlanConfig.of(batch=1, seq=2048, activations="checkpoint", expert_group_size=2)
    block = next(r for r in plan(MIXTRAL, _h100(80e9), cfg, limits=False).rows if r.unit == "block.3")
    rest, group = MIXTRAL.params().block() - 8 * MIXTRAL.params().expert(), 2 * MIXTRAL.params().expert()
    assert grouped_block_numel(MIXTRAL, 2) == rest and 3 * MIXTRAL.hidden_size * MIXTRAL.intermediate_size == \
        MIXTRAL.params().expert()
    assert (block.weight_bytes, block.gradient_bytes) == (2 * (rest + group), 2 * max(rest, group))


@pytest.mark.parametrize("activations", ["resident", "checkpoint"])
def test_a_grouped_blocks_backward_peak_is_its_group_and_two_gradient_pieces(activations):
    """The first block's backward, with nothing prefetched and the update on the host: its weights hold all but
    the experts and one group, and of the moments where a gradient appears the highest holds a group's gradient
    and the larger of the next block's last piece (its rest) and another group's; its workspace's transient is
    one group's backward. Whole, it holds its weights and two whole gradients."""
    shape = MixtralConfig.example()
    size, es = 2, 4
    whole = PlanConfig.of(batch=2, seq=8, compute_dtype="fp32", prefetch=0, update_on="host",
                          activations=activations)
    grouped = whole.replace(expert_group_size=size)
    peaks = {cfg.step.expert_group_size: {r.unit: r.peak_bytes for r in plan(shape, _h100(80e9), cfg).rows}
             for cfg in (whole, grouped)}
    rest, group, block = grouped_block_numel(shape, size), size * shape.params().expert(), shape.params().block()
    transients = [block_backward_transient_bytes(shape, 2, 8, es, g) for g in (size, 0)]
    # weights: the rest and a group; gradients: the group's and the rest's of the block after it, or two groups'
    expected = es * (rest + group + group + max(rest, group) - 3 * block) + transients[0] - transients[1]
    assert peaks[size]["block.0"] - peaks[0]["block.0"] == expected


@pytest.mark.parametrize("activations", ["resident", "checkpoint", "offload"])
def test_smaller_groups_lower_the_peak(activations):
    peaks = [peak_device_bytes(MIXTRAL, PlanConfig.of(batch=1, seq=2048, activations=activations,
                                                       expert_group_size=size)) for size in (8, 4, 2, 1)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    assert peak_device_bytes(MIXTRAL, PlanConfig.of(batch=1, seq=2048, activations=activations)) == peaks[0]


def test_a_checkpointed_grouped_block_reads_its_experts_once_more_in_its_backward():
    """The groups cross once in a block's forward and once in its backward, as the whole block's weights do; a
    checkpointed block's recompute loads them once more. Each group load waits for the compute: no faster."""
    plans = {(activations, size): plan(MIXTRAL, DEVICE_PRESETS["h100-sxm"], PlanConfig.of(
        batch=1, seq=2048, activations=activations, expert_group_size=size, store="disk"), limits=False)
        for activations in ("resident", "checkpoint") for size in (0, 2)}
    experts = MIXTRAL.num_hidden_layers * MIXTRAL.params().experts() * MIXTRAL.params().expert()
    for activations in ("resident", "checkpoint"):
        assert plans[activations, 2].step_time_s > plans[activations, 0].step_time_s
    assert plans["resident", 2].link_bytes["h2d"] == plans["resident", 0].link_bytes["h2d"]
    again = {link: plans["checkpoint", 2].link_bytes[link] - plans["resident", 2].link_bytes[link]
             for link in ("h2d", "disk_read")}
    assert again == {"h2d": 2 * experts, "disk_read": 4 * experts}  # bf16 over the link, the fp32 master read


def test_the_planner_chooses_the_fewest_groups_that_fit():
    cfg = PlanConfig.of(batch=1, seq=2048, activations="checkpoint")

    def fits(memory: float, size: int) -> bool:
        return plan(MIXTRAL, _h100(memory), cfg.replace(expert_group_size=size), limits=False).fits

    for memory, chosen in ((24e9, 0), (8e9, 4), (5e9, 2), (4e9, 1), (3e9, 0)):
        assert fewest_expert_groups(MIXTRAL, _h100(memory), cfg) == chosen
        larger = [g for g in (8, 4, 2, 1) if g > (chosen or 8)]
        if chosen:
            assert fits(memory, chosen) and not any(fits(memory, g) for g in larger)
    assert not fits(3e9, 1)  # nothing fits: whole blocks are planned, and the plan says why
    assert fewest_expert_groups(MIXTRAL, _h100(3e9), cfg.replace(expert_group_size=4)) == 4  # as set
    assert fewest_expert_groups(PRESETS["llama-350m"], _h100(1e6), cfg) == 0  # dense: nothing to group
    why = plan(MIXTRAL, _h100(5e9), cfg.replace(expert_group_size=4), limits=False).does_not_fit
    assert "--expert-group-size 2 (the fewest groups of experts that fit)" in why


def test_a_budget_too_small_for_whole_blocks_is_told_the_fewest_groups_that_fit():
    pc = PlanConfig.of(batch=1, seq=2048, activations="checkpoint")
    needs = {size: peak_device_bytes(MIXTRAL, pc.replace(expert_group_size=size)) + PLAN_MARGIN_BYTES
             for size in (0, 4, 2, 1)}
    assert needs[0] > needs[4] > needs[2] > needs[1]
    assert "--expert-group-size 2 (the fewest groups of experts that fit)" in alternatives(MIXTRAL, pc, needs[4] - 1)
    assert not any("--expert-group-size" in fix for fix in alternatives(MIXTRAL, pc, needs[1] - 1))


def test_a_group_size_must_divide_the_experts_of_a_mixture_trained_whole():
    cfg = PlanConfig.of(batch=1, seq=2048)
    assert expert_group(MIXTRAL, cfg.replace(expert_group_size=8)) == 0  # all of them: whole blocks
    with pytest.raises(SettingError, match=r"must divide a block's 8 experts \(1, 2, 4, 8\), not 3"):
        expert_group(MIXTRAL, cfg.replace(expert_group_size=3))
    with pytest.raises(SettingError, match="dense"):
        expert_group(PRESETS["llama-350m"], cfg.replace(expert_group_size=2))
    with pytest.raises(SettingError, match="on one process: not with LoRA or data parallel"):
        expert_group(MIXTRAL, PlanConfig.of(batch=2, seq=2048, devices=2, data_parallel="sharded",
                                            expert_group_size=2))


def test_streamer_plan_chooses_or_takes_the_group_size(capsys):
    step = ["plan", "--model", "mixtral-8x7b", "--target", "h100-sxm", "--batch", 1, "--seq", 2048,
            "--activations", "checkpoint", "--json"]
    for memory, flags, size, fit in (("24e9", [], 0, True), ("5e9", [], 2, True),
                                     ("5e9", ["--expert-group-size", 4], 4, False)):
        rc, out, _ = run_cli(capsys, *step, "--set", f"memory_bytes={memory}", *flags)
        planned = json.loads(out)
        assert rc == 0 and (planned["config"]["expert_group_size"], planned["fits"]) == (size, fit)
    rc, out, _ = run_cli(capsys, *step[:-1], "--set", "memory_bytes=5e9")
    assert rc == 0 and "experts 2 of 8 at a time" in out
    assert "must divide a block's 8 experts" in fails(capsys, *step, "--expert-group-size", 3)
    assert "--expert-group-size must be an integer >= 0, got -1" in fails(capsys, "train", "--expert-group-size", -1)


@pytest.mark.parametrize("model,size", [("mixtral-8x7b", 3), ("gptj-debug", 2)])
def test_streamer_train_refuses_groups_that_do_not_fit_as_plan_does(capsys, tmp_path: Path, model: str, size: int):
    """A group size that does not divide the experts, or any on a dense model: `train` refuses it in the one line
    `plan` gives, before writing anything."""
    planned = fails(capsys, "plan", "--model", model, "--seq", 16, "--expert-group-size", size)
    run = tmp_path / "run"
    trained = fails(capsys, "train", "--model", model, "--seq", 16, "--batch", 1, "--steps", 1,
                    "--expert-group-size", size, "--run-dir", run)
    assert planned == trained.replace("error: ", "error: cannot plan this step: ")
    assert ("must divide a block's 8 experts (1, 2, 4, 8), not 3" if size == 3 else "dense (use 0)") in trained
    assert not run.exists() and list(tmp_path.iterdir()) == []


def _wide(model_type: str) -> ModelConfig:
    """The family's example with experts wide and many enough that a block's backward is the step's peak."""
    example = FAMILIES[model_type].example()
    experts = {"mixtral": "num_local_experts"}.get(model_type, "num_experts")
    width = {"qwen3_moe": "moe_intermediate_size"}.get(model_type, "intermediate_size")
    return dataclasses.replace(example, **{experts: 8, width: 128})


def _train(cfg: ModelConfig, tc: TrainerConfig, run: Path) -> tuple[list[float], dict[str, torch.Tensor], int]:
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with StreamingTrainer(cfg, tc, store_dir=run) as trainer:
        losses = [trainer.step(ids) for _ in range(2)]
        return losses, trainer.state_dict(), trainer.ledger.peak


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
@pytest.mark.parametrize("store,activations", [("ram", "resident"), ("ram", "checkpoint"), ("disk", "resident"),
                                               ("disk", "checkpoint"), ("ram", "offload")])
def test_training_with_expert_groups_is_training_without_them(tmp_path: Path, model_type: str, store: str,
                                                               activations: str):
    """The same matmuls in the same order, each group's gradient folded into its place: the same losses and
    weights, bit for bit, for every group size; and a lower peak, the runtime's ledger's."""
    cfg = _wide(model_type)
    runs = {size: _train(cfg, TrainerConfig.of(lr=1e-3, dtype="fp32", store=store, activations=activations,
                                               max_grad_norm=1.0, update_chunk=5_000, expert_group_size=size),
                         tmp_path / str(size))
            for size in (0, 4, 1)}
    (losses, weights, peak) = runs.pop(0)
    for grouped_losses, grouped_weights, grouped_peak in runs.values():
        assert grouped_losses == losses and grouped_peak < peak
        assert all(torch.equal(grouped_weights[key], weights[key]) for key in weights)


@pytest.mark.parametrize("activations,size,batch,seq", [("resident", 4, 2, 24), ("resident", 1, 8, 32),
                                                        ("checkpoint", 1, 8, 32)])
def test_a_grouped_blocks_forward_peaks_with_its_last_group_or_at_its_end(tmp_path: Path, activations: str,
                                                                          size: int, batch: int, seq: int):
    """The last block's forward, as the runtime's trace measures it, against the whole block's: all but its
    experts on the device, and then its last group before the experts' outputs are recombined (what that saves,
    per routed token its place, output and weight, not saved yet), or the forward's end, whichever holds more.
    Both cases occur: a group of one expert holds less than 8 x 32 tokens' recombination saves."""
    cfg, es = _wide("mixtral"), 4
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
    peaks = {}
    for group in (0, size):
        tc = TrainerConfig.of(dtype="fp32", store="ram", activations=activations, max_grad_norm=0,
                              update_chunk=5_000, expert_group_size=group)
        with StreamingTrainer(cfg, tc, store_dir=tmp_path / str(group)) as trainer:
            trainer.step(ids)
            peaks[group] = next(s.peak_bytes for s in trainer.trace.spans()
                                if (s.layer, s.phase) == ("block.1", "forward"))
    weights = size * cfg.params().expert() * es
    later = 0 if activations != "resident" else batch * seq * 2 * (8 + es * cfg.hidden_size + es)
    assert (weights > later) == (size == 4 or activations != "resident")
    experts = cfg.params().experts() * cfg.params().expert() * es
    assert peaks[size] - peaks[0] == max(weights - later, 0) - experts


@pytest.mark.parametrize("dtype,activations,store", [("fp32", "resident", "ram"), ("bf16", "checkpoint", "disk"),
                                                     ("bf16", "resident", "ram"), ("fp32", "offload", "ram")])
def test_planner_dry_run_and_real_run_agree_with_expert_groups(tmp_path: Path, dtype: str, activations: str,
                                                               store: str):
    """The grouped step's peak, at a block's backward, is the plan's, the real run's and the dry run's; the bytes its
    store's files move are the plan's."""
    cfg = _wide("mixtral")
    for size in (4, 2):
        tc = TrainerConfig.of(dtype=dtype, activations=activations, update_chunk=5_000, store=store, max_grad_norm=0,
                              expert_group_size=size)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        with StreamingTrainer(cfg, tc, store_dir=tmp_path / str(size)) as trainer:
            trainer.step(ids)
            real, moved = trainer.ledger.peak, trainer.step_bytes
        pc = tc.plan_config(2, 24)
        planned = plan(cfg, DEVICE_PRESETS["h100-sxm"], pc)
        assert planned.peak_at[0].startswith("block.")
        assert real == planned.peak_device_bytes == dry_run(cfg, tc, 2, 24).peak
        assert moved == step_disk_bytes(cfg, pc)  # each group's pieces read, a recompute's twice


def test_generation_and_evaluation_with_expert_groups_are_as_without(tmp_path: Path):
    cfg = _wide("mixtral")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for size in (0, 2):
        tc = TrainerConfig.of(dtype="fp32", store="ram", max_grad_norm=0, expert_group_size=size)
        with StreamingTrainer(cfg, tc, store_dir=tmp_path / str(size)) as trainer:
            trainer.step(ids)
            out[size] = generate(trainer, ids[:, :4], Sampling(6, temperature=0.0)), trainer.evaluate(ids)
    assert torch.equal(out[0][0], out[2][0]) and out[0][1] == out[2][1]


def test_the_runtime_checks_the_group_size(tmp_path: Path):
    for shape, flat, why in ((MixtralConfig.example(), {"expert_group_size": 3}, "must divide a block's 4 experts"),
                             (PRESETS["llama-350m"], {"expert_group_size": 2}, "dense"),
                             (MixtralConfig.example(), {"expert_group_size": 2, "lora_rank": 4}, "not with LoRA")):
        with pytest.raises(ConfigError, match=why):
            StreamingTrainer(shape, TrainerConfig.of(**flat), store_dir=tmp_path / "run")


def test_only_a_mixture_of_experts_has_experts():
    for shape in (PRESETS["llama-350m"], PRESETS["gptj-6b"]):
        params = shape.params()
        assert (params.experts(), params.expert(), shape.costs().experts_saved_after_per_token(2)) == (0, 0, 0)
    assert isinstance(MIXTRAL, ModelConfig) and MIXTRAL.params().experts() == 8


def test_train_groups_the_experts_where_whole_blocks_exceed_its_budget(capsys, tmp_path: Path, tiny_setup: Path):
    """`streamer train`'s default loads whole blocks where they fit its --budget, else the fewest groups of
    experts that fit: it says so in a line, config.toml records the size, and the run trains."""
    cfg = _wide("mixtral").resized(vocab_size=512, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg.adapter().to_hf()))
    flags = {"model": str(tmp_path / "config.json"), "data": str(tiny_setup / "train.txt"),
             "tokenizer": str(tiny_setup / "tok"), "steps": 1, "batch": 2, "seq": 16, "dtype": "fp32",
             "store": "ram", "activations": "checkpoint", "update_chunk": 10_000, "sample_tokens": 0,
             "eval_fraction": 0}
    run_cfg = resolve(flags)
    needs = {size: planned_peak(cfg, run_cfg.replace(expert_group_size=size)) + PLAN_MARGIN_BYTES
             for size in (0, 4, 2, 1)}
    assert needs[0] > needs[4] > needs[2] > needs[1]
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    rc, out, err = run_cli(capsys, "train", *argv, "--run-dir", tmp_path / "run", "--budget", needs[4])
    assert rc == 0, err
    assert f"experts in groups of 4: whole blocks need {format_size(needs[0])}" in out
    assert "expert_group_size = 4" in (tmp_path / "run" / "config.toml").read_text()
    assert "too small" in fails(capsys, "train", *argv, "--run-dir", tmp_path / "small", "--budget", needs[1] - 1)
    # `plan` searches the same way (expert_groups.fewest_groups_within): on a device with that much memory, no
    # reserve and no CUDA allocator, it chooses the same groups, and whole blocks where the budget holds them.
    step = [a for a in argv if a.split("=")[0] in {f"--{k}" for k in ("model", "batch", "seq", "dtype", "store",
                                                                       "activations", "update-chunk")}]
    for budget, size in ((needs[4], 4), (needs[2], 2), (needs[0], 0)):
        rc, out, err = run_cli(capsys, "plan", *step, "--update-on", "device", "--target", "cs2", "--set",
                               f"memory_bytes={budget}", "--json")
        assert rc == 0, err
        assert json.loads(out)["config"]["expert_group_size"] == size


def test_resuming_with_groups_that_do_not_fit_names_the_flag(capsys, tmp_path: Path, tiny_setup: Path):
    """`train --resume RUN --expert-group-size 3` on a run whose blocks hold 8 experts: refused in one line that
    names the flag, as a new run's refusal does, before the store is opened for training."""
    model = tmp_path / "mixtral.json"
    model.write_text(json.dumps(dataclasses.replace(MixtralConfig.example(), num_local_experts=8)
                                .resized(vocab_size=512, max_position_embeddings=64).adapter().to_hf()))
    run = tmp_path / "run"
    args = tiny_args(tiny_setup, run, 1)
    args[args.index("--model") + 1] = model
    rc, _, err = run_cli(capsys, *args)
    assert rc == 0, err
    refused = fails(capsys, "train", "--resume", run, "--steps", 2, "--expert-group-size", 3)
    assert refused == "error: --expert-group-size must divide a block's 8 experts (1, 2, 4, 8), not 3"
    assert RunDir.open(run).committed_step() == 1


@pytest.mark.parametrize("device", ["cs2", "h100-sxm"])
def test_plan_and_train_choose_the_same_groups_for_the_same_limit(capsys, tmp_path: Path, tiny_setup: Path,
                                                                    device: str):
    """One search against one measure (`planner.step_needs`): `streamer plan` on a device and `streamer train`
    with that device as its --budget choose the same group size at every limit, on the edge of each size's need
    too. The step is train's default (disk tier, fused, clipping on: a step that clips is made again after the
    backward), and on a GPU its allocator's blocks and cuBLAS's workspaces count."""
    from memory_model.planner import step_needs
    from streamer.advice import fit_expert_groups

    cfg = _wide("mixtral").resized(vocab_size=512, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg.adapter().to_hf()))
    step = ["--model", str(tmp_path / "config.json"), "--batch", "2", "--seq", "16", "--dtype", "fp32",
            "--activations", "checkpoint", "--update-chunk", "10000", "--update-on", "device"]
    reserve = DEVICE_PRESETS[device].reserve_bytes
    run_cfg = resolve({"model": str(tmp_path / "config.json"), "data": str(tiny_setup / "train.txt"), "batch": 2,
                       "seq": 16, "dtype": "fp32", "activations": "checkpoint", "update_chunk": 10_000,
                       "update_on": "device", "budget": device})
    arch, pc = run_cfg.trainer.device.cuda_arch(), run_cfg.plan_config()
    assert pc.fused and run_cfg.trainer.optimizer.max_grad_norm > 0 and bool(arch) == (device != "cs2")
    needs = {size: step_needs(cfg, pc.replace(expert_group_size=size), arch, clips=True) for size in (0, 4, 2, 1)}
    assert needs[0] > needs[4] > needs[2] > needs[1]
    for limit, size in ((needs[0], 0), (needs[0] - 1, 4), (needs[4], 4), (needs[4] - 1, 2), (needs[2] - 1, 1)):
        memory = f"memory_bytes={limit + reserve}"
        trained, _ = fit_expert_groups(cfg, run_cfg.replace(set=(memory,)))
        rc, out, err = run_cli(capsys, "plan", *step, "--target", device, "--set", memory, "--json")
        assert rc == 0, err
        assert trained.trainer.step.expert_group_size == json.loads(out)["config"]["expert_group_size"] == size
