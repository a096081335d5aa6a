"""LoRA on a streamed frozen base: the same step as a resident reference, the base never written, the planner
equal to the ledger, resume bit-identical, and the PEFT export loaded by peft with our logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layers import (
    FAMILIES, GPTJ, PRESETS, GPTJConfig, GptOssConfig, ModelConfig, Olmo2Config, OlmoeConfig, Phi3Config,
    Qwen3MoeConfig, causal_lm_loss,
)
from layers.lora import add_adapters
from memory_model import PlanConfig, device_spec, plan
from memory_model.lora import adapter_params
from memory_model.schedule import adapter_charges
from streamer import StreamingTrainer, TrainerConfig
from streamer.cli.generate import open_trainer
from streamer.cli.main import main
from streamer.errors import ConfigError
from streamer.run_dir import RunDir
from streamer.runtime.lora import Adapters

CFG = GPTJConfig.preset("gptj-debug")
TARGETS = "q_proj,v_proj,out_proj,fc_in,fc_out"


def _reference(base: dict[str, torch.Tensor], adapters: Adapters) -> tuple[GPTJ, list[torch.Tensor]]:
    """A resident GPTJ with the trainer's adapters copied into LoraLinear modules; the adapters' tensors."""
    model = GPTJ(CFG, init=False)
    model.load_hf_state_dict(base)
    lora = adapters.lora
    for block in model.transformer.h:
        add_adapters(block, lora.target_names, lora.rank, lora.scaling, lora.dropout)
    model.requires_grad_(False)
    leaves = []
    for i, block in enumerate(model.transformer.h):
        for key, value in adapters.params[f"block.{i}"].items():
            param = block.get_parameter(key)
            param.data.copy_(value.detach())
            param.requires_grad_(True)
            leaves.append(param)
    return model, leaves


@pytest.mark.parametrize("leading", [(5,), (2, 3)])
def test_a_lora_linear_is_its_base_plus_the_scaled_adapters_product_forward_and_backward(leading: tuple) -> None:
    """x W^T + b + scaling B A x in float64, and the gradients of x, A and B as autograd takes them through that
    sum written out, for a (tokens, in) and a (batch, seq, in) input."""
    torch.manual_seed(0)
    lora = add_adapters(torch.nn.Sequential(torch.nn.Linear(6, 4)), ("0",), rank=2, scaling=1.5, dropout=0.0)[0]
    lora.double().requires_grad_(True)
    torch.nn.init.normal_(lora.lora_B.weight)  # PEFT's B starts at zero, which would hide a wrong scaling
    x = torch.randn(*leading, 6, dtype=torch.float64, requires_grad=True)
    a, b = lora.lora_A.weight, lora.lora_B.weight
    want = x @ lora.weight.T + lora.bias + 1.5 * (x @ a.T) @ b.T
    got = lora(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    expected = torch.autograd.grad(want, (x, a, b), grad)
    for actual, reference in zip(torch.autograd.grad(got, (x, a, b), grad), expected, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-12, atol=1e-12)


def test_a_lora_step_equals_a_resident_reference_and_leaves_the_base_alone(tmp_path: Path) -> None:
    tc = TrainerConfig.of(dtype="fp32", grad_accum=2, lr=1e-2, lora_rank=4, lora_alpha=8.0,
                          lora_targets=TARGETS, activations="checkpoint", store="disk")
    ids = torch.randint(0, CFG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "run") as trainer:
        torch.manual_seed(1)
        for tensors in trainer.adapters.params.values():  # B starts at zero; make the adapters matter
            for t in tensors.values():
                t.data.normal_(0, 0.05)
        base = trainer.state_dict(merged=False)
        model, leaves = _reference(base, trainer.adapters)
        files = sorted(p.name for p in (tmp_path / "run" / "slabs").iterdir())
        loss = trainer.step(ids)
        assert trainer.state_dict(merged=False).keys() == base.keys()
        assert all(torch.equal(v, base[k]) for k, v in trainer.state_dict(merged=False).items())
        assert sorted(p.name for p in (tmp_path / "run" / "slabs").iterdir()) == files  # no new generation
        streamed = [t.detach().clone() for tensors in trainer.adapters.params.values() for t in tensors.values()]

    opt = tc.optimizer
    optimizer = torch.optim.AdamW(leaves, lr=1e-2, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    losses = [causal_lm_loss(model(half), half) for half in ids.chunk(2)]
    (sum(losses) / 2).backward()
    torch.nn.utils.clip_grad_norm_(leaves, tc.optimizer.max_grad_norm)
    optimizer.step()
    assert loss == pytest.approx(float(sum(losses).detach() / 2), rel=1e-6)
    for ours, theirs in zip(streamed, leaves, strict=True):
        # One Adam step of lr 1e-2 from gradients that sum in another order (chunked loss, streamed units):
        # measured at most 4.6e-6 apart, where a gradient near zero makes Adam's m / sqrt(v) sensitive.
        assert (ours - theirs.detach()).abs().max().item() <= 5e-5


LLAMA = PRESETS["llama-debug"]
OLMO2 = Olmo2Config.example().resized(max_position_embeddings=64)
PHI3 = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, pad_token_id=0)
PHI3_GQA = Phi3Config.example().resized(max_position_embeddings=64)  # longrope, its long factors at 48
# Sliding and global layers (each its own fp32 RoPE table), a window shorter than the sequence, q/k norms.
GEMMA = FAMILIES["gemma3_text"].example().resized(max_position_embeddings=64)
QWEN3_MOE = Qwen3MoeConfig.example().resized(max_position_embeddings=64)
OLMOE = OlmoeConfig.example().resized(max_position_embeddings=64)
GPT_OSS = GptOssConfig.example().resized(max_position_embeddings=64)  # sinks, a window, clamped experts


@pytest.mark.parametrize("model,dtype,activations,dropout,targets", [
    (CFG, "fp32", "resident", 0.0, "q_proj,v_proj"),
    (CFG, "bf16", "resident", 0.1, "q_proj,v_proj,fc_in,fc_out"),
    (CFG, "fp32", "checkpoint", 0.1, "v_proj,out_proj,fc_out"),
    (CFG, "bf16", "checkpoint", 0.0, TARGETS),
    # Grouped-query attention and SwiGLU: k/v adapters narrower than q's, three MLP projections.
    (LLAMA, "fp32", "resident", 0.0, "q_proj,v_proj"),
    (LLAMA, "bf16", "checkpoint", 0.1, ",".join(LLAMA.lora().projections)),
    (LLAMA, "bf16", "resident", 0.0, "k_proj,o_proj,gate_proj,down_proj"),
    # Norms after the sublayers: the adapters of q/k/v read the block's input itself, q/k norms over whole
    # projections, one on the MLP's output.
    (OLMO2, "fp32", "resident", 0.0, "q_proj,v_proj"),
    (OLMO2, "fp32", "checkpoint", 0.0, "k_proj,up_proj"),
    (OLMO2, "bf16", "checkpoint", 0.1, ",".join(OLMO2.lora().projections)),
    (OLMO2, "bf16", "resident", 0.0, "o_proj,gate_proj,down_proj"),
    (OLMO2, "bf16", "checkpoint", 0.0, ",".join(OLMO2.lora().projections)),
    # Fused projections: q, k and v need a gradient together; the family's default targets (qkv_proj).
    (PHI3, "fp32", "resident", 0.0, ""),
    (PHI3, "bf16", "checkpoint", 0.1, ",".join(PHI3.lora().projections)),
    (PHI3, "bf16", "resident", 0.0, "o_proj,down_proj"),
    (PHI3, "fp32", "resident", 0.0, "gate_up_proj"),
    (PHI3_GQA, "bf16", "resident", 0.0, "qkv_proj,gate_up_proj"),
    (GEMMA, "fp32", "resident", 0.0, "v_proj,up_proj"),  # block.0 rotates nothing: block.2 owns its table
    (GEMMA, "fp32", "resident", 0.0, "q_proj,o_proj,down_proj"),
    (GEMMA, "bf16", "checkpoint", 0.1, ",".join(GEMMA.lora().projections)),
    (GEMMA, "bf16", "resident", 0.0, "k_proj,gate_proj"),
    # A mixture of experts: frozen experts and router under attention's adapters, and the experts' own (a pair
    # per expert on the routed rows; the first block's MLP input needs no gradient, so only their paths save).
    (QWEN3_MOE, "fp32", "resident", 0.0, "q_proj,v_proj"),
    (QWEN3_MOE, "bf16", "checkpoint", 0.1, "q_proj,k_proj,v_proj,o_proj"),
    (OLMOE, "bf16", "resident", 0.0, "q_proj,k_proj"),  # q/k norms over the whole projections
    (QWEN3_MOE, "fp32", "resident", 0.0, "experts.gate_up_proj,experts.down_proj"),
    (QWEN3_MOE, "bf16", "checkpoint", 0.0, ",".join(QWEN3_MOE.lora().projections)),
    (OLMOE, "bf16", "resident", 0.0, "experts.down_proj"),
    (QWEN3_MOE, "bf16", "resident", 0.0, "experts.gate_up_proj"),
    (OLMOE, "fp32", "checkpoint", 0.0, "o_proj,experts.gate_up_proj"),
    (OLMOE, "bf16", "resident", 0.0, "v_proj,experts.gate_up_proj"),
    (GPT_OSS, "fp32", "resident", 0.0, "q_proj,v_proj"),
    (GPT_OSS, "bf16", "checkpoint", 0.1, ",".join(GPT_OSS.lora().projections)),
    (GPT_OSS, "bf16", "resident", 0.0, "k_proj,o_proj"),
    (GPT_OSS, "bf16", "resident", 0.0, "v_proj"),  # block.0's probabilities saved for v's adapters, not its mask
], ids=lambda v: v.model_type if isinstance(v, ModelConfig) else None)
def test_planner_equals_the_lora_ledger(tmp_path: Path, model: ModelConfig, dtype: str, activations: str,
                                        dropout: float, targets: str) -> None:
    tc = TrainerConfig.of(dtype=dtype, activations=activations, update_chunk=20_000, lora_rank=4,
                          lora_dropout=dropout, lora_targets=targets)
    with StreamingTrainer(model, tc, store_dir=tmp_path / "run") as trainer:
        ids = torch.randint(0, model.vocab_size, (2, 48))
        trainer.step(ids)
        trainer.step(ids)
        real = trainer.ledger.peak, trainer.ledger.peak_breakdown
        assert trainer.ledger.in_use == sum(c.nbytes for c in adapter_charges(trainer.adapters.numel()))
        assert trainer.adapters.numel() == adapter_params(model, tc.lora)
    predicted = plan(model, device_spec("h100-sxm"),
                     PlanConfig.of(batch=2, seq=48, activations=activations, compute_dtype=dtype, update_chunk=20_000,
                                   lora=tc.lora))
    assert predicted.peak_breakdown == real[1]  # measured: equal to the byte in every case
    assert predicted.peak_device_bytes == real[0]


def _train(run: Path, steps: int, *extra: str) -> None:
    assert main(["train", "--model", "gptj-debug", "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1",
                 "--lora-targets", TARGETS, "--run-dir", str(run), "--steps", str(steps), "--batch", "2",
                 "--seq", "32", "--lr", "1e-2", "--dtype", "fp32", "--eval-every", "0", "--sample-tokens", "4",
                 *extra]) == 0


def test_lora_resume_is_bit_identical(tmp_path: Path) -> None:
    _train(tmp_path / "straight", 4)
    _train(tmp_path / "resumed", 2)
    assert main(["train", "--resume", str(tmp_path / "resumed"), "--steps", "4"]) == 0
    states = [load_file(next((tmp_path / name / "store").glob("lora-*"))) for name in ("straight", "resumed")]
    assert [p.name for p in (tmp_path / "resumed" / "store").glob("lora-*")] == ["lora-00000004.safetensors"]
    assert {k for k in states[0] if k.startswith("params/")} and states[0].keys() == states[1].keys()
    for key, value in states[0].items():  # the adapters and AdamW's state
        assert torch.equal(value, states[1][key]), key
    losses = [[r["loss"] for r in RunDir(tmp_path / name).read_metrics() if "loss" in r]
              for name in ("straight", "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_a_lora_state_file_is_checked_and_an_older_pickled_one_still_reads(tmp_path: Path, capsys) -> None:
    """One flipped bit in `lora-<step>.safetensors` is refused in one line naming the file, where a pickle
    exported it as a weight; a run from before, whose adapters are `lora-<step>.pt`, reads and trains on."""
    run = tmp_path / "run"
    _train(run, 2)
    (path,) = (run / "store").glob("lora-*")
    assert path.name == "lora-00000002.safetensors"
    with open_trainer(RunDir(run)) as trainer:
        weights = trainer.state_dict()
        params = {f"{u}/{k}": t.detach().cpu().clone() for u, ts in trainer.adapters.params.items()
                  for k, t in ts.items()}
        optimizer = trainer.adapters.optimizer.state_dict()
    intact = path.read_bytes()
    capsys.readouterr()
    for offset in (len(intact) - 1, 20):  # a tensor's byte; the header's
        flipped = bytearray(intact)
        flipped[offset] ^= 0x40
        path.write_bytes(bytes(flipped))
        assert main(["export", str(run), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{path} is damaged" in err and "checksum" in err, err
        assert not (tmp_path / "out").exists()
    path.unlink()  # the run as an earlier version wrote it
    torch.save({"params": params, "optimizer": optimizer}, run / "store" / "lora-00000002.pt")
    with open_trainer(RunDir(run)) as trainer:
        again = trainer.state_dict()
        assert all(torch.equal(again[k], weights[k]) for k in weights)
        state = trainer.adapters.optimizer.state_dict()["state"]
        assert all(torch.equal(v, optimizer["state"][i][k]) for i in state for k, v in state[i].items())
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert main(["train", "--resume", str(run), "--steps", "3", "--sample-tokens", "0"]) == 0
    assert [p.name for p in (run / "store").glob("lora-*")] == ["lora-00000003.safetensors"]


def test_peft_export_loads_in_peft_with_our_logits(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    import transformers
    run, adapter, merged = tmp_path / "run", tmp_path / "adapter", tmp_path / "merged"
    _train(run, 3)
    assert main(["export", str(run), str(adapter), "--format", "peft"]) == 0
    assert main(["export", str(run), str(merged)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == TARGETS.split(",")

    with open_trainer(RunDir(run)) as trainer:
        base, state, cfg = trainer.state_dict(merged=False), trainer.state_dict(), trainer.cfg  # the data's vocabulary
    hf_base = transformers.GPTJForCausalLM(transformers.GPTJConfig(**cfg.adapter().to_hf()))
    hf_base.load_state_dict(base, strict=False)  # the attention bias buffers are HF's own
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = hf_base.eval()(ids).logits
    loaded = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
    ours = GPTJ(cfg, init=False)
    ours.load_hf_state_dict(state)
    exported = transformers.GPTJForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        expected = ours(ids)
        assert (base_logits - expected).abs().max().item() > 1e-2  # the adapters changed the model
        # Measured 3.1e-7 (PEFT on the base) and 2.4e-7 (the merged export) in fp32.
        assert (loaded(input_ids=ids).logits - expected).abs().max().item() <= 1e-4
        assert (exported(ids).logits - expected).abs().max().item() <= 1e-4
    assert main(["generate", str(run), "--prompt", "The", "--max-new-tokens", "4"]) == 0


def test_a_peft_export_that_fails_part_way_leaves_the_earlier_export_whole(tmp_path: Path, monkeypatch) -> None:
    """The adapter folder is written beside the destination and swapped in whole: a failure while writing it
    (here the tensors' file, after adapter_config.json) keeps the export --overwrite was replacing, and leaves
    no staging folder."""
    import streamer.export
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    _train(run, 2)
    assert main(["export", str(run), str(adapter), "--format", "peft"]) == 0
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}

    def full_disk(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(streamer.export, "save_file", full_disk)
    assert main(["export", str(run), str(adapter), "--format", "peft", "--overwrite"]) == 2
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "run"]


def test_wrong_lora_settings_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "gptj-debug", "--lora-rank", "4", "--lora-targets", "q_proj,lm_head"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        'error: --lora-targets must be distinct names among q_proj,k_proj,v_proj,out_proj,fc_in,fc_out,o_proj,'
        'gate_proj,up_proj,down_proj,qkv_proj,gate_up_proj,experts.gate_up_proj,experts.down_proj, got '
        '"q_proj,lm_head"')
    with pytest.raises(ConfigError, match="lora_rank must be an integer >= 0"):
        TrainerConfig.of(lora_rank=-1)


def test_a_merged_export_under_bf16_is_the_full_precision_base_plus_the_adapter(tmp_path: Path, tiny_setup,
                                                                                tiny_hf_model) -> None:
    """A bf16 LoRA run keeps its frozen base in bf16; the merged export takes the base from the fp32 checkpoint
    the run started from, so it equals PEFT's base plus adapter, and the untouched weights are the source's."""
    peft = pytest.importorskip("peft")
    import transformers
    from conftest import TINY_RUN_MODEL
    from safetensors.torch import load_file

    from streamer.io.tokenizer import load_tokenizer
    source, moved, run, merged, adapter = (tmp_path / n for n in ("hf", "moved", "run", "merged", "adapter"))
    tiny_hf_model(TINY_RUN_MODEL).save_pretrained(source)
    load_tokenizer(tiny_setup / "tok").save(source)
    assert main(["train", "--from-pretrained", str(source), "--data", str(tiny_setup / "train.txt"), "--lora-rank", "4",
                 "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,fc_out", "--run-dir", str(run), "--steps", "3",
                 "--batch", "2", "--seq", "32", "--lr", "1e-2", "--dtype", "bf16", "--eval-fraction", "0",
                 "--sample-tokens", "0"]) == 0
    assert main(["export", str(run), str(merged)]) == 0
    assert main(["export", str(run), str(adapter), "--format", "peft"]) == 0
    base, ours = load_file(str(source / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    adapted = ("q_proj", "v_proj", "fc_out")
    assert all(t.dtype == torch.float32 for t in ours.values())  # the source's dtype
    untouched = [k for k in ours if not any(f".{name}." in k for name in adapted)]
    assert "transformer.h.0.mlp.fc_in.weight" in untouched  # 1.5e-3 from the source when taken from the bf16 store
    assert all(torch.equal(ours[k], base[k]) for k in untouched)
    assert not torch.equal(ours["transformer.h.0.attn.q_proj.weight"], base["transformer.h.0.attn.q_proj.weight"])

    ids = torch.randint(0, TINY_RUN_MODEL.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
        with_adapter = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
            source, attn_implementation="eager"), adapter).eval()
        logits, peft_logits = exported(ids).logits, with_adapter(input_ids=ids).logits
        # fp32 noise: transformers' own two attention kernels on the merged model, against each other.
        sdpa = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="sdpa").eval()
        noise = (sdpa(ids).logits - logits).abs().max().item()
    # Measured: merged vs PEFT 1.9e-6, eager vs sdpa 1.4e-6; with the base from the bf16 store, 2.1e-2 apart.
    assert (logits - peft_logits).abs().max().item() <= 4 * max(noise, 1e-6), noise

    source.rename(moved)
    err = _fails_export(str(run), str(tmp_path / "again"))
    assert f"{source} (this LoRA run's base checkpoint) is not there" in err and "pass --base HF_DIR" in err
    assert main(["export", str(run), str(tmp_path / "again"), "--base", str(moved)]) == 0
    assert all(torch.equal(t, ours[k]) for k, t in load_file(str(tmp_path / "again" / "model.safetensors")).items())


def _fails_export(*argv: str) -> str:
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "streamer", "export", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    return done.stderr
