"""Tied input and output embeddings (`tie_word_embeddings`: Llama-3.2-1B/3B, the small Qwens) are one parameter:
held by the embedding's state, used by the head, with one master, one pair of moments and one update fed by
both gradients. Held against transformers' tied classes with torch's AdamW, on both tiers, both update places
and both update timings; planned to the byte; exported tied again."""
from __future__ import annotations

import dataclasses
import json
import signal

import pytest
import safetensors
import torch
import torch.multiprocessing as mp
import transformers

from layers import PRESETS, LlamaConfig, Olmo2Config, Qwen2Config, resident_model
from memory_model import PlanConfig, device_spec, plan
from memory_model.planner import step_disk_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run
from streamer.errors import CheckpointError
from tests.test_cli import run_cli
from tests.test_families import assert_export_is_transformers, hf_model
from tests.test_llama import _TINY
from tests.test_runtime import hf_reference

TIED = {"llama": LlamaConfig(**_TINY, tie_word_embeddings=True),
        "qwen2": Qwen2Config(**_TINY, tie_word_embeddings=True),
        "olmo2": Olmo2Config(**_TINY, tie_word_embeddings=True)}  # its padding row: a gradient from lm_head only


def test_the_preset_has_the_published_count_and_one_copy_of_the_tied_weight():
    cfg = PRESETS["llama-3.2-1b"]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.lm_head.weight is hf.model.embed_tokens.weight
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 1_235_814_400
    assert cfg.params().own("head") == cfg.hidden_size  # its final norm: the embedding's state holds lm_head
    assert cfg.params().device("head") == cfg.hidden_size + cfg.vocab_size * cfg.hidden_size


@pytest.mark.parametrize("name", TIED)
def test_logits_equal_transformers_within_its_fp32_noise(name):
    cfg = TIED[name]
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    exact = hf_model(cfg, torch.float64)(ids).logits
    noise = max((hf_model(cfg, attn=attn)(ids).logits.double() - exact).abs().max().item()
                for attn in ("eager", "sdpa"))
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict({k: v for k, v in hf_model(cfg).state_dict().items() if k != "lm_head.weight"})
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    with torch.no_grad():
        error = (ours(ids).double() - exact).abs().max().item()
    assert error <= 2 * noise, (error, noise)


@pytest.mark.parametrize("name,store,update_on,timing,max_grad_norm", [
    ("llama", "ram", "device", "after-backward", 1.0),
    ("qwen2", "ram", "host", "after-backward", 1.0),
    ("llama", "disk", "host", "after-backward", 1.0),  # journaled
    ("qwen2", "disk", "device", "fused", 1.0),  # the fused update clips: the step is made again after the backward
    ("llama", "disk", "device", "fused", 1e3),  # the fused update stands
    ("olmo2", "ram", "device", "after-backward", 1.0),
])
def test_streamed_training_equals_transformers_and_adamw(tmp_path, name, store, update_on, timing, max_grad_norm):
    """Three steps of two micro-batches: the tied weight's gradient sums the head's and the embedding's uses
    over both micro-batches, is clipped by the global norm, and takes one AdamW update."""
    cfg = TIED[name]
    tc = TrainerConfig.of(lr=1e-3, max_grad_norm=max_grad_norm, weight_decay=0.1, dtype="fp32", store=store,
                          update_on=update_on, update_timing=timing, grad_accum=2, update_chunk=1000)
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, cfg.vocab_size, (4, 16), generator=g) for _ in range(3)]
    start = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(start)
        assert sum(trainer.store.numels.values()) == cfg.num_params()  # one copy of the tied weight
        losses = [trainer.step(ids, ids) for ids in data]
        norms = trainer.grad_norm
        state = {k: v.double() for k, v in trainer.state_dict().items()}
        assert trainer.fused == (timing == "fused")
        assert (trainer.clipped_redos > 0) == (timing == "fused" and max_grad_norm == 1.0)
    assert (norms > max_grad_norm) == (max_grad_norm == 1.0)  # the clipping cases clip
    steps = [(ids, ids) for ids in data]
    exact, exact_losses = hf_reference(start, steps, tc, cfg)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    # k_proj's bias (qwen2) has an exact gradient of zero: Adam turns rounding noise into its update.
    compared = [k for k in exact if not k.endswith("k_proj.bias")]
    noise = max(max((s[k].double() - exact[k]).abs().max().item() for k in compared)
                for s, _ in (hf_reference(start, steps, tc, cfg, torch.float32, attn) for attn in ("eager", "sdpa")))
    error = max((state[k] - exact[k]).abs().max().item() for k in compared)
    assert error <= 2 * noise, (error, noise)
    assert losses == pytest.approx(exact_losses, abs=1e-5)


@pytest.mark.parametrize("dtype,activations,store,timing", [
    ("bf16", "resident", "ram", "auto"), ("fp32", "checkpoint", "disk", "fused"),
    ("bf16", "checkpoint", "disk", "after-backward")])
def test_planner_dry_run_and_real_run_agree_to_the_byte(tmp_path, dtype, activations, store, timing):
    """The tied head holds the embedding's weight and gradient on the device as an untied one would; the
    embedding's accumulator takes both folds: the ledger, the dry run, the planner and the store's files agree."""
    cfg = dataclasses.replace(PRESETS["llama-debug"], tie_word_embeddings=True)
    tc = TrainerConfig.of(dtype=dtype, activations=activations, update_chunk=20_000, store=store, grad_accum=2,
                          update_timing=timing, max_grad_norm=0)
    settings = PlanConfig.of(batch=4, seq=48, compute_dtype=dtype, activations=activations, update_chunk=20_000,
                             store=store, grad_accum=2, update_timing=timing)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (4, 48)))
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
        assert trainer.step_bytes == step_disk_bytes(cfg, settings)
    assert store == "ram" or trainer.step_bytes[0] > 0
    dry = dry_run(cfg, tc, 4, 48)
    planned = plan(cfg, device_spec("h100-sxm"), settings)
    assert real[0] == dry.peak == planned.peak_device_bytes
    assert real[1] == dict(dry.peak_breakdown)
    assert (planned.link_bytes["disk_read"], planned.link_bytes["disk_write"]) == trainer.step_bytes  # its timing


def test_a_tied_transformers_folder_trains_and_exports_tied(capsys, tmp_path, tiny_setup):
    """transformers writes a tied model's weight once (model.embed_tokens.weight); the CLI trains that folder
    and exports it the same way, which transformers loads tied, with our logits and greedy generation."""
    cfg = dataclasses.replace(TIED["qwen2"], vocab_size=512, max_position_embeddings=64)
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    with safetensors.safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    run, out = tmp_path / "run", tmp_path / "out"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", tmp_path / "hf", "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--steps", 2, "--batch", 2,
                         "--seq", 16, "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, out)
    assert rc == 0, err
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safetensors.safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert (before.lm_head.weight - exported.lm_head.weight).abs().max() > 0  # training changed the tied weight
    assert_export_is_transformers(cfg, run, out, exported)


@pytest.mark.slow
def test_a_tied_run_killed_mid_step_continues_bit_identically(tmp_path, tiny_setup):
    """SIGKILL after the first step's record, then the same command: the weights and losses of an
    uninterrupted run, bit for bit, with the tied weight's journaled gradient holding both uses."""
    from tests.test_lifecycle import assert_same_run, kill_when, metric_lines, streamer, train_argv

    setup = tmp_path / "setup"
    setup.mkdir()
    cfg = dataclasses.replace(TIED["llama"], vocab_size=512, max_position_embeddings=64)
    (setup / "config.json").write_text(json.dumps(cfg.adapter().to_hf()))
    for name in ("train.txt", "tok"):
        (setup / name).symlink_to(tiny_setup / name)
    reference, run = tmp_path / "reference", tmp_path / "run"
    done = streamer(*train_argv(setup, reference, "--update-timing", "after-backward"))
    assert done.returncode == 0, done.stderr
    argv = train_argv(setup, run, "--update-timing", "after-backward")
    assert kill_when(argv, lambda: metric_lines(run) >= 1).returncode == -signal.SIGKILL
    done = streamer(*argv)
    assert done.returncode == 0 and "continuing it to step" in done.stdout, done.stderr
    assert_same_run(run, reference)


# test_distributed's batches (tokens below 256, 32 per row); odd sizes, so that each of the two ranks' slices
# of the tied weight and of the head's norm ends in padding.
DP_CFG = dataclasses.replace(TIED["llama"], vocab_size=257, hidden_size=33, head_dim=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode,store", [("replicated", "disk"), ("sharded", "disk"), ("sharded", "ram")])
def test_two_gloo_ranks_equal_one_process(tmp_path, mode, store):
    """Replicated, each rank all-reduces the head's gradient, the tied part included, and folds that part into
    its embedding's accumulator. Sharded, each rank stores half of the embedding's state and half of the
    head's: the head's load gathers the two apart, and the two parts of its gradient are reduce-scattered
    apart, the tied part's slice into the embedding's accumulator. Every rank makes the one process's update,
    and its device peak is the planner's."""
    from tests.test_distributed import TC, _max_diff, run_data_parallel, single_process
    tc = TC.replace(store=store, data_parallel=mode)
    ranks = run_data_parallel(tmp_path, [("new", 3)], tc, DP_CFG)
    reference = single_process(tmp_path, 3, tc.replace(data_parallel="replicated"), DP_CFG)
    assert _max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
    assert torch.equal(ranks[0]["state"]["lm_head.weight"], ranks[0]["state"]["model.embed_tokens.weight"])
    assert _max_diff(ranks[0]["state"], reference["state"]) <= 1e-5
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=2e-6)
    planned = plan(DP_CFG, device_spec("h100-sxm"), PlanConfig.of(
        batch=4, seq=32, compute_dtype="fp32", store=store, update_chunk=tc.step.update_chunk, devices=2,
        data_parallel=mode))
    assert [r["peak"] for r in ranks] == [planned.peak_device_bytes] * 2


@pytest.mark.slow
def test_a_sharded_rank_killed_mid_update_resumes_bit_identically(tmp_path):
    """Rank 1 SIGKILLs itself in step 2's update, after both ranks journaled it; both reopen the run, roll
    step 2 forward (the embedding's journaled gradient holds the head's tied part) and make step 3: the
    weights of the uninterrupted sharded run, bit for bit."""
    from tests.test_distributed import _free_port, _max_diff, run_data_parallel
    from tests.test_sharded_data_parallel import SHARDED, _killed_main, _resumed_main
    run, out = str(tmp_path / "run"), str(tmp_path / "result")
    with pytest.raises(mp.ProcessExitedException):
        mp.spawn(_killed_main, args=(2, _free_port(), run, DP_CFG), nprocs=2, join=True)
    mp.spawn(_resumed_main, args=(2, _free_port(), run, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert [r["steps"] for r in ranks] == [2, 2]  # rank 1 rolled the journaled step 2 forward
    (tmp_path / "uninterrupted").mkdir()
    uninterrupted = run_data_parallel(tmp_path / "uninterrupted", [("new", 3)], SHARDED, DP_CFG)
    assert _max_diff(ranks[0]["state"], uninterrupted[0]["state"]) == 0.0


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_lora_on_a_tied_model_holds_what_an_untied_one_does(tmp_path, store):
    """A LoRA run's frozen base: the tied head reads the embedding's compute weights with its own. The device
    holds what it holds untied (ledger and dry run), and the store's files move what the planner says."""
    cfg = dataclasses.replace(PRESETS["llama-debug"], tie_word_embeddings=True)
    tc = TrainerConfig.of(dtype="bf16", store=store, lora_rank=4, lora_targets="q_proj,v_proj", grad_accum=2)
    settings = PlanConfig.of(batch=4, seq=32, compute_dtype="bf16", store=store, grad_accum=2, lora=tc.lora)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (4, 32)))
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
        assert trainer.step_bytes == step_disk_bytes(cfg, settings)
    untied = dry_run(PRESETS["llama-debug"], tc, 4, 32)
    assert real == (untied.peak, dict(untied.peak_breakdown)) == (dry_run(cfg, tc, 4, 32).peak, real[1])


def test_a_tied_lora_run_exports_merged_and_as_a_peft_adapter(capsys, tmp_path, tiny_setup):
    """A LoRA run on a tied transformers folder (Llama-3.2-1B's case): the merged export writes the tied weight
    once, and the PEFT adapter loads in peft on the transformers base; both give our run's logits."""
    import peft
    from streamer.cli.generate import open_trainer
    from streamer.run_dir import RunDir
    from tests.test_lifecycle import streamer
    cfg = dataclasses.replace(TIED["qwen2"], vocab_size=512, max_position_embeddings=64)
    source, run, merged, adapter = (tmp_path / n for n in ("hf", "run", "merged", "adapter"))
    hf_model(cfg).save_pretrained(source)
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", source, "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--steps", 2, "--batch", 2, "--seq", 16,
                         "--dtype", "fp32", "--lr", 1e-2, "--lora-rank", 4, "--lora-alpha", 8,
                         "--lora-targets", "q_proj,v_proj,o_proj,down_proj", "--sample-tokens", 0,
                         "--eval-fraction", 0)
    assert rc == 0, err
    for argv in ((run, merged), (run, adapter, "--format", "peft")):
        done = streamer("export", *map(str, argv))
        assert done.returncode == 0, done.stderr
    with safetensors.safe_open(merged / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    with open_trainer(RunDir(run)) as trainer:
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(trainer.state_dict())  # adapters merged

    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
        assert (base(ids).logits - expected).abs().max().item() > 1e-2  # the adapters changed the model
        with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
        exported = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
        logits = exported(ids).logits
        # fp32 noise: transformers' own two attention kernels on the merged model, against each other.
        sdpa = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="sdpa").eval()
        noise = max((sdpa(ids).logits - logits).abs().max().item(), 1e-6)
        errors = [(logits - expected).abs().max().item(),
                  (with_adapter(input_ids=ids).logits - expected).abs().max().item()]
    # Measured: the merged export 2.3e-6 and PEFT 3.7e-6 from our run; eager vs sdpa 2.3e-6.
    assert max(errors) <= 4 * noise, (errors, noise)
    rc, _, err = run_cli(capsys, "generate", run, "--prompt", "The", "--max-new-tokens", 4)  # the adapters, streamed
    assert rc == 0, err


def test_a_tied_folder_that_also_names_lm_head_is_read_as_transformers_reads_it(tmp_path):
    """Some writers keep the tied weight's second name too. Equal, the import takes the one tensor; different,
    transformers would untie the model, which a tied config cannot say: one line names the fix."""
    from safetensors.torch import save_file
    cfg = TIED["llama"]
    model = hf_model(cfg)
    model.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with StreamingTrainer.from_pretrained(tmp_path, TrainerConfig.of(dtype="fp32", store="ram")) as trainer:
        assert torch.equal(trainer.state_dict()["lm_head.weight"], state["model.embed_tokens.weight"])
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert reloaded.lm_head.weight is not reloaded.model.embed_tokens.weight  # transformers untied it
    with pytest.raises(CheckpointError, match="set it to false") as info:
        StreamingTrainer.from_pretrained(tmp_path, TrainerConfig.of(dtype="fp32", store="ram"))
    assert "\n" not in str(info.value) and "lm_head.weight differs from model.embed_tokens.weight" in str(info.value)


def test_a_state_dict_whose_tied_copies_differ_is_one_line():
    cfg = TIED["llama"]
    state = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32", store="ram")) as trainer:
        trainer.load_state_dict(state)  # transformers' state_dict names the tied weight twice, one tensor
        state["lm_head.weight"] = state["lm_head.weight"] + 1
        with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight") as info:
            trainer.load_state_dict(state)
    assert "\n" not in str(info.value)


def test_plan_shards_a_tied_model_as_train_does(capsys):
    """Each of the two ranks stores half of every unit's state, the tied weight's included."""
    def planned(mode: str) -> dict:
        rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.2-1b", "--target", "h100-sxm", "--ranks", "2",
                               "--data-parallel", mode, "--json")
        assert rc == 0, err
        return json.loads(out)
    sharded, replicated = planned("sharded"), planned("replicated")
    assert 2 * sharded["host_store_bytes"] == replicated["host_store_bytes"]
