"""The update fused into the backward: bit-identical to the update after the backward, and its disk bytes.

A fused update runs unclipped as each unit's gradient becomes final; a step whose clipping triggers is
rolled back to the previous state files and made again after the backward, and a step with a non-finite
gradient is rolled back and skipped. These tests compare both schedules weight for weight over steps that
clip and steps that do not, with gradient accumulation and with a poisoned gradient, and compare the bytes
the store's files moved with the planner's count for the same step.
"""
from __future__ import annotations

import json

import pytest

from conftest import assert_same_tensors, debug_batches, train_debug
from layers import GPTJConfig, LlamaConfig, ModelConfig
from memory_model import device_spec, plan
from memory_model.planner import planned_spec, step_disk_bytes
from memory_model.schedule import (
    StepSpec, Weights, folded_by_chunk, kept_masters, load_order, loads_keeping_master, releases, resident_sets,
    step_events, updated_from_backward,
)
from memory_model.shapes import PlanConfig
from streamer import Placement, StreamingTrainer, TrainerConfig
from streamer.advice import step_host
from streamer.calibration.dryrun import dry_run
from streamer.errors import ConfigError

CFG = GPTJConfig.preset("gptj-debug")
STEPS = 4
# Small chunks so that every unit's update has several; lr large enough for the norm to move between steps.
DISK = TrainerConfig.of(store="disk", dtype="fp32", update_chunk=5000, lr=3e-3, nonfinite="skip")


@pytest.mark.parametrize("accum,moments,dtype", [(1, "fp32", "fp32"), (2, "bf16", "bf16"), (1, "bf16", "fp32")])
def test_fused_update_is_bit_identical_when_clipping_triggers_on_some_steps(tmp_path, accum, moments, dtype):
    base = DISK.replace(grad_accum=accum, moment_dtype=moments, dtype=dtype)
    unclipped = train_debug(tmp_path / "free", base.replace(max_grad_norm=0), STEPS)
    norms = sorted(unclipped.norms)
    # A threshold between the steps' norms: the early steps clip, the later ones do not (or the reverse).
    limit = (norms[1] + norms[2]) / 2
    after = train_debug(tmp_path / "after", base.replace(max_grad_norm=limit, update_timing="after-backward"), STEPS)
    fused = train_debug(tmp_path / "fused", base.replace(max_grad_norm=limit, update_timing="fused"), STEPS)
    assert after[0] == fused[0]
    assert_same_tensors(after[1], fused[1])
    clipped = [n > limit for n in after.norms]
    assert 0 < sum(clipped) < STEPS, "the threshold must make some steps clip and leave others"
    # A fused step that clips is made again after the backward, and so are the steps after it until one does
    # not clip: a redo at each step that clips after one that did not.
    assert fused.redos == sum(c and (i == 0 or not clipped[i - 1]) for i, c in enumerate(clipped))
    assert after.redos == 0


def test_fused_update_without_clipping_matches_and_never_redoes(tmp_path):
    after = train_debug(tmp_path / "after", DISK.replace(max_grad_norm=0, update_timing="after-backward"), STEPS)
    fused = train_debug(tmp_path / "fused", DISK.replace(max_grad_norm=0), STEPS)
    assert after[0] == fused[0] and fused.redos == 0
    assert_same_tensors(after[1], fused[1])


@pytest.mark.parametrize("precision", [dict(moment_dtype="int8", update_chunk=20 * 256),
                                       dict(master_dtype="bf16", dtype="bf16")], ids=["int8-moments", "bf16-master"])
def test_fused_rollback_and_clipping_are_bit_identical_in_the_opt_in_precisions(tmp_path, monkeypatch, precision):
    """A fused step that is not finite is rolled back to the previous state files and skipped, and a step that
    clips is made again after the backward: both give the bits of the update after the backward, with quantized
    moments and with a stochastically rounded bf16 master too."""
    base = DISK.replace(max_grad_norm=0, **precision)

    def run(name, **flat):
        return train_debug(tmp_path / name, base.replace(**flat), 6, monkeypatch, poisoned_step=1)

    norms = sorted(n for n in run("free").norms if n == n)
    limit = (norms[1] + norms[2]) / 2  # some steps clip, the others do not
    after = run("after", max_grad_norm=limit, update_timing="after-backward")
    fused = run("fused", max_grad_norm=limit, update_timing="fused")
    assert len(fused[0]) == 5 and after[0] == fused[0]
    assert_same_tensors(after[1], fused[1])
    clipped = sum(n > limit for n in after.norms if n == n)
    assert 0 < fused.redos and 0 < clipped < 5


# The compute weights in RAM (bf16, rebuilt from the masters): the rollback refills them from the files too.
@pytest.mark.parametrize("accum,store", [(1, "disk"), (2, "disk"), (1, Placement("ram", "disk", "disk"))])
def test_fused_step_with_a_nonfinite_gradient_is_rolled_back_and_skipped(tmp_path, monkeypatch, accum, store):
    tc = DISK.replace(grad_accum=accum, store=store, dtype="bf16" if store != "disk" else "fp32",
                      max_grad_norm=0)  # every step fused (a step that clips is made again after the backward)

    def run(name, timing):
        return train_debug(tmp_path / name, tc.replace(update_timing=timing), STEPS, monkeypatch, poisoned_step=1)

    after, fused = run("after", "after-backward"), run("fused", "fused")
    assert len(after[0]) == len(fused[0]) == STEPS - 1
    assert after[0] == fused[0]
    assert_same_tensors(after[1], fused[1])
    manifest = json.loads((tmp_path / "fused" / "manifest.json").read_text())
    assert manifest["step"] == STEPS - 1
    # No other generation, no tmp file and no journal is left of the rolled-back step.
    names = sorted(p.name for p in (tmp_path / "fused" / "slabs").iterdir() if p.suffix != ".grad")
    assert names == sorted(f"{u}.{g}.state" for u, g in manifest["units"].items())
    assert not (tmp_path / "fused" / "journal.json").exists()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_update_on_the_disk_tier_matches_the_ram_tier(tmp_path, dtype):
    """bf16: the RAM tier's compute copy and the disk tier's cast of the master on each load are the same."""
    base = DISK.replace(dtype=dtype, max_grad_norm=0)
    ram = train_debug(tmp_path / "ram", base.replace(store="ram"), STEPS)
    fused = train_debug(tmp_path / "fused", base.replace(update_timing="fused"), STEPS)
    assert fused.redos == 0
    assert ram[0] == fused[0]
    assert_same_tensors(ram[1], fused[1])


def test_fused_update_needs_the_state_on_disk():
    with pytest.raises(ConfigError, match="needs the state on disk"):
        TrainerConfig.of(store="ram", update_timing="fused")
    assert not PlanConfig.of(batch=1, seq=8, store="ram").fused
    assert PlanConfig.of(batch=1, seq=8, store="disk").fused
    assert not PlanConfig.of(batch=2, seq=8, store="disk", devices=2).fused


@pytest.mark.parametrize("timing", ["fused", "after-backward"])
@pytest.mark.parametrize("accum,moments,dtype,prefetch", [(1, "fp32", "bf16", 1), (2, "bf16", "fp32", 2),
                                                          (1, "bf16", "bf16", 0)])
def test_store_bytes_per_step_are_the_planners(tmp_path, timing, accum, moments, dtype, prefetch):
    tc = DISK.replace(grad_accum=accum, moment_dtype=moments, dtype=dtype, prefetch=prefetch,
                      update_timing=timing, max_grad_norm=0)
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "run") as trainer:
        for ids in debug_batches(2):
            trainer.step(ids)
            plan = PlanConfig.of(batch=2, seq=16, compute_dtype=dtype, grad_accum=accum, prefetch=prefetch,
                                 update_chunk=tc.step.update_chunk, store="disk", update_timing=timing,
                                 moment_dtype=moments)
            assert trainer.step_bytes == step_disk_bytes(CFG, plan)


def test_fused_bytes_per_parameter_are_the_floor():
    """Per parameter, fused, fp32 master, bf16 compute: reads are the fp32 master twice (forward; backward,
    whose load also gives the update its master; the head's once, as it stays from its forward into its
    backward) plus the moments; writes are master and moments. No compute copy, and the gradient never
    reaches the store."""
    n, head = CFG.num_params(), CFG.params().own("head")
    for moments, moment_bytes in (("bf16", 4), ("fp32", 8)):
        plan = PlanConfig.of(batch=2, seq=16, store="disk", update_timing="fused", moment_dtype=moments)
        assert step_disk_bytes(CFG, plan) == ((4 + 4 + moment_bytes) * n - 4 * head, (4 + moment_bytes) * n)


@pytest.mark.parametrize("master_from_weights", [True, False])
def test_a_fused_update_takes_the_master_of_each_units_last_weights_load(master_from_weights):
    units = CFG.unit_names()
    numels = {u: CFG.params().own(u) for u in units}
    events = step_events(StepSpec(tuple(units), 2, numels, 5000, fused=True, master_from_weights=master_from_weights))
    assert all(e.resource.master != master_from_weights for e in events if e.phase == "update")
    kept = [r for r, keep in zip(load_order(events, 1), loads_keeping_master(events, 1), strict=True) if keep]
    # the head's load from its last forward (it stays into its backward), then each backward's load
    assert kept == ([Weights(u) for u in reversed(units)] if master_from_weights else [])


@pytest.mark.parametrize(("fused", "prefetch"), [(True, 2), (True, 1), (False, 2)])
def test_a_fused_backward_and_its_updates_load_the_next_backwards_weights_first(fused, prefetch):
    """Fused with two or more slots ahead, a unit's backward and each of its update chunks give the first slot to
    the next backward's weights, ahead of the state chunks: the next unit's compute never waits behind this unit's
    state. With one slot, or unfused, the lookahead keeps its order. Never more than `prefetch` resources ahead."""
    units = CFG.unit_names()
    numels = {u: CFG.params().own(u) for u in units}
    events = step_events(StepSpec(tuple(units), 1, numels, 5000, fused=fused, master_from_weights=True))
    resident = resident_sets(events, prefetch)
    assert all(len(held) <= 1 + prefetch for k, held in enumerate(resident) if events[k].phase != "backward")
    backward = [k for k, e in enumerate(events) if e.phase == "backward"]
    if not fused:
        assert all(e.phase == "backward" for e in events[backward[0]:backward[-1] + 1])
        return
    assert any(e.phase == "update" for e in events[backward[0]:backward[1]])
    leads = [resident[k][1] == events[following].resource
             for here, following in zip(backward, backward[1:], strict=False) for k in range(here, following)]
    assert all(leads) if prefetch >= 2 else not all(leads)
    assert all(len(resident[k]) == 1 + prefetch for k, e in enumerate(events) if e.phase == "forward")


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("fused,micro_batches", [(False, 1), (False, 2), (True, 1), (True, 2)])
@pytest.mark.parametrize("large", ["none", "folded", "from backward"])
def test_whatever_a_step_has_loaded_is_in_the_resident_set_until_it_is_released(prefetch, fused, micro_batches, large):
    """The planner prices each event's resident set, and the executor holds every load it issued until its release:
    the two are the same only if no resident set leaves out a resource loaded earlier and not yet released. At the
    turn, the head's forward fetches ahead what its backward keeps (its backward's lead, then its first chunks), not
    chunks that the backward's lead would push out of the window while they stay on the device. Units over twice a
    block, folded by chunk or updated from the backward's gradient, and several update chunks per unit."""
    units = ("embed", "block.0", "block.1", "block.2", "head")
    wide = frozenset() if large == "none" else frozenset({"embed", "head"})
    spec = StepSpec(units, micro_batches, {u: 400 if u in wide else 100 for u in units}, 50, fused=fused,
                    by_chunk=wide, from_backward=wide if large == "from backward" and fused and micro_batches == 1
                    else frozenset())
    events = step_events(spec)
    held: set = set()
    for k, resident in enumerate(resident_sets(events, prefetch)):
        held |= set(resident)
        assert held == set(resident), (k, events[k])
        held -= set(releases(events, k))
    assert not held


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_kept_master_is_held_from_its_loads_issue_to_its_units_last_update_chunk(prefetch):
    """Where the device is the host, a fused update takes each unit's fp32 master from its last weights load. With
    two slots ahead, the next backward's weights (and master) come while the head's update holds the head's: the
    plan prices both at once (GPT-J-6B on the CPU's disk tier: 4.45 GiB measured, 3.84 planned with one)."""
    units = CFG.unit_names()
    events = step_events(StepSpec(tuple(units), 1, {u: CFG.params().own(u) for u in units}, 5000, fused=True,
                                  master_from_weights=True))
    resident = resident_sets(events, prefetch)
    held = kept_masters(events, resident)
    order, keeping = load_order(events, prefetch), loads_keeping_master(events, prefetch)
    for unit in units:
        spans = [k for k, kept in enumerate(held) if unit in kept]
        assert spans == list(range(spans[0], spans[-1] + 1))  # one span, unbroken
        last_update = max(k for k, e in enumerate(events) if e.phase == "update" and e.unit == unit)
        assert spans[-1] == last_update
        # from the event that issues the load: its weights enter the resident sets there
        assert Weights(unit) in resident[spans[0]] and Weights(unit) not in resident[spans[0] - 1]
    assert sum(keeping) == len(units)
    assert all(isinstance(r, Weights) for r, keep in zip(order, keeping, strict=True) if keep)
    head_backward = next(k for k, e in enumerate(events) if e.phase == "backward")
    last = f"block.{CFG.num_hidden_layers - 1}"
    assert held[head_backward] == ({"head", last} if prefetch == 2 else {"head"})
    unfused = step_events(StepSpec(tuple(units), 1, {u: 100 for u in units}, 50, fused=False))
    assert not any(kept_masters(unfused, resident_sets(unfused, 2)))


# Embeddings over twice a block (gptj-debug's blocks hold 49,600 parameters), untied and tied: each is folded through
# its gradient file a block at a time, and its fused update loads each chunk's gradient and master.
WIDE = {"untied": GPTJConfig(vocab_size=2048, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
        "tied": LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                            tie_word_embeddings=True)}


def _train(cfg: ModelConfig, root, tc: TrainerConfig) -> tuple[list[float], dict, tuple[int, int], list[float], int]:
    with StreamingTrainer(cfg, tc, store_dir=root) as trainer:
        norms = []
        for ids in debug_batches(STEPS):
            trainer.step(ids)
            norms.append(sum(trainer.executor.grad_sq_norms.values()) ** 0.5)
        return trainer.losses, trainer.state_dict(), trainer.step_bytes, norms, trainer.ledger.peak


@pytest.mark.parametrize("model", WIDE)
def test_a_unit_much_larger_than_a_block_is_folded_and_updated_by_chunk_with_the_same_bits(tmp_path, model):
    """No fp32 copy of a unit over twice a block. Untied, one micro-batch makes its whole gradient: the fused
    update takes each chunk from the backward's gradient, and the fold only sums its norm. Tied, the head's
    backward adds to the embedding's: its gradient is folded through its file in blocks, and its fused update
    loads each chunk's gradient and master. The bits are the RAM tier's (which holds it whole), and a step
    that clips gives those of the update after the backward; the files move what the planner counts."""
    cfg = WIDE[model]
    by_chunk = folded_by_chunk(cfg, DISK.step)
    assert "embed" in by_chunk and ("head" in by_chunk) == (model == "untied")
    assert not folded_by_chunk(cfg, TrainerConfig.of(store="ram").step)
    assert updated_from_backward(cfg, DISK.step) == (by_chunk if model == "untied" else frozenset())
    assert not updated_from_backward(cfg, DISK.replace(grad_accum=2).step)
    base = DISK.replace(max_grad_norm=0, dtype="fp32")
    ram = _train(cfg, tmp_path / "ram", base.replace(store="ram"))
    fused = _train(cfg, tmp_path / "fused", base.replace(update_timing="fused"))
    assert ram[0] == fused[0]
    assert_same_tensors(ram[1], fused[1])
    tc = base.replace(update_timing="fused")
    pc = tc.plan_config(2, 16)
    assert fused[2] == step_disk_bytes(cfg, pc)
    # Untied, no gradient file is written: only each unit's new master and moments (fp32: 12 B/param).
    assert (fused[2][1] == 12 * cfg.num_params()) == (model == "untied")
    assert plan(cfg, device_spec("h100-sxm"), pc).peak_device_bytes == fused[4] == dry_run(cfg, tc, 2, 16).peak
    # No host buffer of the embedding's size: the fold is a block's, and no master but a block's is kept.
    host, block = step_host(cfg, tc, pc), cfg.params().own("block.0")
    assert host.fold == 4 * block and host.master <= 4 * block
    events = step_events(planned_spec(cfg, pc))
    kept = set().union(*kept_masters(events, resident_sets(events, pc.step.prefetch)))
    assert "embed" not in kept and ("head" in kept) == (model == "tied")  # tied, the head owns its final norm
    norms = sorted(fused[3])
    limit = (norms[1] + norms[2]) / 2  # the early steps clip, the later ones do not (or the reverse)
    after = _train(cfg, tmp_path / "after", base.replace(max_grad_norm=limit, update_timing="after-backward"))
    clipped = _train(cfg, tmp_path / "clipped", base.replace(max_grad_norm=limit, update_timing="fused"))
    assert after[0] == clipped[0] and 0 < sum(n > limit for n in after[3]) < STEPS
    assert_same_tensors(after[1], clipped[1])


def test_a_bf16_gradient_taken_from_the_backward_gives_the_bits_of_the_update_after_it(tmp_path):
    """The untied embedding and head in bf16 compute, bf16 master and int8 moments: each fused update chunk casts
    the backward's bf16 gradient to fp32, as the fold after the backward does; the bits are the same, and the files
    move what the planner counts, without the gradient files."""
    tc = DISK.replace(max_grad_norm=0, dtype="bf16", master_dtype="bf16", moment_dtype="int8", update_chunk=4864)
    cfg = WIDE["untied"]
    after = _train(cfg, tmp_path / "after", tc.replace(update_timing="after-backward"))
    fused = _train(cfg, tmp_path / "fused", tc.replace(update_timing="fused"))
    assert after[0] == fused[0]
    assert_same_tensors(after[1], fused[1])
    assert fused[2] == step_disk_bytes(cfg, tc.replace(update_timing="fused").plan_config(2, 16))
    # Two slots ahead, as the scale runs load: the head's forward fetches what its backward holds, and the ledger's
    # peak is the plan's to the byte.
    ahead = tc.replace(update_timing="fused", prefetch=2)
    assert _train(cfg, tmp_path / "ahead", ahead)[4] == plan(cfg, device_spec("h100-sxm"),
                                                             ahead.plan_config(2, 16)).peak_device_bytes


def test_llama_8b_takes_its_embedding_and_head_gradients_from_the_backward():
    """docs/MEMORY_MODEL.md: Llama-3.1-8B's fused disk-tier step (bf16 master, int8 moments, 1 x 512) moves 76.2 GiB,
    not the 84.1 it would fold its untied embedding's and head's fp32 gradients through their files for."""
    cfg = ModelConfig.preset("llama-3.1-8b")
    tc = TrainerConfig.of(store="disk", dtype="bf16", master_dtype="bf16", moment_dtype="int8",
                          activations="checkpoint")
    pc = tc.plan_config(1, 512)
    assert pc.fused and updated_from_backward(cfg, pc.step) == {"embed", "head"}
    read, written = step_disk_bytes(cfg, pc)
    folded = 4 * (cfg.params().own("embed") + cfg.params().own("head"))  # written once and read once
    assert round((read + written) / 2**30, 1) == 76.2
    assert round((read + written + 2 * folded) / 2**30, 1) == 84.1
