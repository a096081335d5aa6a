"""What is the mixture-of-experts families' own (tests/test_families.py holds each against transformers by its
example): the published shapes' parameter counts, their planned FLOPs and elementwise work (the active
experts'), an expert no token chose stepped as torch's AdamW steps it, data parallel with an expert that only
one rank's tokens chose, the device peak whatever the routing, the experts' two matmul paths, and transformers'
files with their experts one tensor each."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from layers import PRESETS, MixtralConfig, ModelConfig, Qwen3MoeConfig, resident_model
from layers.llama.config import LlamaConfig
from layers.moe.units import GroupedLinear, SparseMoe
from memory_model import DEVICE_PRESETS, PlanConfig, plan
from memory_model.kernels import KernelCosts, gpu_elementwise_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run
from tests.test_families import hf_model
from tests.test_runtime import hf_fp32_noise, hf_reference


def transformers_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf()))
    return sum(p.numel() for p in model.parameters())


def test_presets_have_transformers_parameter_counts():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B of them a token's (attention, the router, 8 of 128 experts);
    Mixtral-8x7B: 46.7B; OLMoE-1B-7B: 6.9B."""
    cfg = PRESETS["qwen3-30b-a3b"]
    assert cfg.num_params() == transformers_count(cfg) == 30_532_122_624
    active = cfg.embed_params() + cfg.head_params() + cfg.num_hidden_layers * (
        cfg.block_params() - cfg.mlp_params() + cfg.mlp_matmul_params())
    assert 3.3e9 < active < 3.4e9
    assert PRESETS["mixtral-8x7b"].num_params() == transformers_count(PRESETS["mixtral-8x7b"]) == 46_702_792_704
    assert PRESETS["olmoe-1b-7b"].num_params() == transformers_count(PRESETS["olmoe-1b-7b"]) == 6_919_161_856


def transformers_matmul_params(cfg: ModelConfig) -> int:
    """The weights a token's matmuls go through in transformers' model, counted apart from ours: every matrix
    but the embedding's (a gather), the fused experts' k of E, none of the norms' vectors."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf()))
    embedding = model.get_input_embeddings().weight
    share = cfg.num_experts_per_tok / cfg.num_experts
    return round(sum(p.numel() * (share if ".experts." in name else 1)
                     for name, p in model.named_parameters() if p.dim() > 1 and p is not embedding))


def test_the_planned_flops_are_the_active_experts():
    """Qwen3-30B-A3B's planned step is 3 x the forward's matmuls: 2 FLOPs per token and weight a token goes
    through (attention's projections, the router, 8 of 128 experts, the head: 3.0B of its 30.5B parameters, by
    transformers' modules), and attention's QK^T and AV."""
    cfg, batch, seq = PRESETS["qwen3-30b-a3b"], 1, 2048
    active = transformers_matmul_params(cfg)
    assert 2.9e9 < active < 3.1e9
    attention = cfg.num_hidden_layers * 4 * batch * seq * seq * cfg.attention_width
    planned = plan(cfg, DEVICE_PRESETS["h100-sxm"], PlanConfig.of(batch=batch, seq=seq))
    assert sum(row.forward_flops for row in planned.rows) == 2 * batch * seq * active + attention
    assert planned.model_flops == 3 * (2 * batch * seq * active + attention)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b"])
def test_a_mixtures_elementwise_work_is_its_active_experts(preset: str):
    """A block's kernels beside the matmuls are priced for the MLP a token goes through: those of a dense block
    as wide as its k experts together (Mixtral's intermediate_size is one expert's width, Qwen3-MoE's a dense
    width no layer has), on a GPU's HBM and by a CPU's measured kernel costs."""
    cfg = PRESETS[preset]
    dense_class = next(c for c in type(cfg).__mro__[1:] if issubclass(c, LlamaConfig))  # Qwen3, Mistral, Llama
    dense = dense_class(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(dense_class)},
                           "intermediate_size": cfg.num_experts_per_tok * cfg.expert_width})
    costs = KernelCosts(**{f.name: 1.0 for f in dataclasses.fields(KernelCosts)})
    for phase in ("forward", "backward"):
        assert gpu_elementwise_bytes(cfg, "block.0", phase, 2, 256, 2) == \
            gpu_elementwise_bytes(dense, "block.0", phase, 2, 256, 2)
    assert costs.forward_s(cfg, "block.0", 2, 256) == costs.forward_s(dense, "block.0", 2, 256)
    assert costs.backward_s(cfg, "block.0", 2, 256) == costs.backward_s(dense, "block.0", 2, 256)


def test_an_expert_no_token_chose_is_stepped_as_torch_adamw_steps_it(tmp_path: Path):
    """Three tokens and one expert each of sixteen: most experts get no token in a step. transformers' fused
    tensor gives them a zero gradient, so AdamW only decays them; the streamed run's weights are torch's within
    transformers' own fp32 noise, and those experts' are decay alone to fp32 rounding."""
    cfg = dataclasses.replace(Qwen3MoeConfig.example(), num_experts=16, num_experts_per_tok=1)
    lr, decay = 1e-2, 0.1
    tc = TrainerConfig.of(lr=lr, weight_decay=decay, dtype="fp32", store="ram", max_grad_norm=1.0)
    ids = torch.randint(0, cfg.vocab_size, (1, 3), generator=torch.Generator().manual_seed(7))
    steps = [(ids, ids)] * 2
    start = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(start)
        for batch, labels in steps:
            trainer.step(batch, labels)
        ours = trainer.state_dict()
    exact = hf_reference(start, steps, tc, cfg)
    noise, _ = hf_fp32_noise(start, steps, tc, exact, cfg)
    assert max((ours[k].double() - exact[0][k]).abs().max().item() for k in ours) <= 2 * noise
    key = "model.layers.0.mlp.experts.down_proj"
    decayed = start[key].double() * (1 - lr * decay) ** len(steps)
    idle = [e for e in range(cfg.num_experts) if torch.allclose(exact[0][key][e], decayed[e], rtol=1e-12, atol=0)]
    assert len(idle) >= cfg.num_experts - 2 * 3  # at most 3 experts a step took a token
    for e in idle:
        torch.testing.assert_close(ours[key][e].double(), decayed[e], rtol=2e-7, atol=0)


def experts_chosen(cfg: ModelConfig, state: dict[str, torch.Tensor], ids: torch.Tensor) -> list[set[int]]:
    """Per block, the experts the tokens of `ids` are routed to by the weights `state`."""
    model = resident_model(cfg, init=False)
    model.load_hf_state_dict(state)
    chosen: list[set[int]] = []
    for moe in (m for m in model.modules() if isinstance(m, SparseMoe)):
        moe.register_forward_hook(lambda m, args, _: chosen.append(set(
            m.gate(args[0].reshape(-1, cfg.hidden_size)).topk(m.top_k).indices.flatten().tolist())))
    with torch.no_grad():
        model(ids)
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("family,data_parallel,store", [(Qwen3MoeConfig, "replicated", "disk"),
                                                        (MixtralConfig, "sharded", "ram")])
def test_two_gloo_ranks_equal_one_process(tmp_path: Path, family, data_parallel: str, store: str):
    """Two data-parallel processes equal one process on the same global batch, and each rank's device peak is
    the planner's. With 64 experts, 2 a token, each rank's 64 tokens leave some expert without a row that the
    other rank's tokens chose (checked): its gradient is zero on one rank and not on the other, and the sum
    across ranks (all-reduced, or reduce-scattered into each rank's half) is the one process's."""
    from tests.test_distributed import TC, _max_diff, global_batches, run_data_parallel, single_process

    experts = "num_local_experts" if family is MixtralConfig else "num_experts"
    cfg = dataclasses.replace(family.example(), vocab_size=256, **{experts: 64})  # test_distributed's token ids
    tc = TC.replace(data_parallel=data_parallel, store=store)
    with StreamingTrainer(cfg, TC, store_dir=tmp_path / "start") as trainer:  # the weights every run starts from
        start = trainer.state_dict()
    rows = global_batches(1)[0].split(2)  # each rank's micro-batch of the first step
    routed = list(zip(*(experts_chosen(cfg, start, ids) for ids in rows)))
    assert any(ours - theirs or theirs - ours for ours, theirs in routed)
    ranks = run_data_parallel(tmp_path, [("new", 2)], tc, cfg)
    reference = single_process(tmp_path, 2, tc.replace(data_parallel="replicated"), cfg)
    assert _max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
    assert _max_diff(ranks[0]["state"], reference["state"]) <= 1e-5  # as GPT-J's (test_distributed.py)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=2e-6)
    planned = plan(cfg, DEVICE_PRESETS["h100-sxm"], PlanConfig.of(
        batch=4, seq=32, compute_dtype="fp32", store=store, update_chunk=10_000, devices=2,
        data_parallel=data_parallel)).peak_device_bytes
    assert [r["peak"] for r in ranks] == [planned, planned]


@pytest.mark.parametrize("dtype,activations,store", [("fp32", "resident", "ram"), ("bf16", "checkpoint", "disk")])
def test_the_device_peak_is_the_same_for_any_routing(tmp_path: Path, dtype: str, activations: str, store: str):
    """The experts are dropless and unpadded: whatever the routing, their tensors hold the N x k routed rows
    (GroupedLinear's output is one buffer, each expert's rows a slice of it). So a step whose router sends every
    token to the same k experts (a zero router: every token's probabilities tie) peaks where one whose tokens
    spread over every expert does, at the plan's peak and the dry run's, to the byte."""
    cfg = Qwen3MoeConfig.example()
    tc = TrainerConfig.of(dtype=dtype, activations=activations, update_chunk=5_000, store=store, max_grad_norm=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "start") as trainer:
        spread = trainer.state_dict()
    forced = {k: torch.zeros_like(v) if k.endswith(".mlp.gate.weight") else v for k, v in spread.items()}
    assert all(len(experts) == cfg.num_experts for experts in experts_chosen(cfg, spread, ids))
    assert all(len(experts) == cfg.num_experts_per_tok for experts in experts_chosen(cfg, forced, ids))
    planned = plan(cfg, DEVICE_PRESETS["h100-sxm"], PlanConfig.of(
        2, 24, compute_dtype=dtype, activations=activations, update_chunk=5_000, store=store)).peak_device_bytes
    assert dry_run(cfg, tc, 2, 24).peak == planned
    for name, start in (("spread", spread), ("forced", forced)):
        with StreamingTrainer(cfg, tc, store_dir=tmp_path / name) as trainer:
            trainer.load_state_dict(start)
            trainer.step(ids)
            assert trainer.ledger.peak == planned, name


def test_the_grouped_matmul_is_one_matmul_per_expert_with_tokens():
    """Rows grouped by expert times each expert's weight, and autograd's gradients through `weight[e]`: the same
    in float64 (where no kernel rounds differently), the weight's gradient zero for the expert with no rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    sizes = [2, 0, 4, 1]
    ours = GroupedLinear.apply(x, w, sizes)
    reference = torch.cat([rows @ w[e].t() for e, rows in enumerate(x.split(sizes))])
    upstream = torch.randn(7, 3, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(ours, (x, w), upstream)
    expected = torch.autograd.grad(reference, (x, w), upstream)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert torch.count_nonzero(grads[1][1]) == 0


@pytest.mark.parametrize("family,saved", [(Qwen3MoeConfig, "model.layers.1.mlp.experts.3.up_proj.weight"),
                                           (MixtralConfig, "model.layers.1.block_sparse_moe.experts.3.w3.weight")])
def test_a_transformers_folder_holds_each_expert_apart_and_loads_fused(tmp_path: Path, family, saved: str):
    """transformers writes each expert's projections as tensors of their own (Mixtral's under its older module
    names, its router too); the checkpoint reads them as the fused tensors the model holds, and the export
    writes them back as transformers wrote them."""
    from streamer.io.hf import HFCheckpoint, HFExporter

    cfg = family.example()
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    with HFCheckpoint.open(tmp_path / "hf") as checkpoint:
        checkpoint.validate()
        state = {key: checkpoint.read(key) for key in checkpoint.keys()}
    theirs = hf_model(cfg).state_dict()
    assert set(state) == set(theirs) and all(torch.equal(state[k], theirs[k]) for k in theirs)
    with HFExporter(tmp_path / "out", cfg) as exporter:
        for key, tensor in state.items():
            exporter.add(key, tensor)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as written, \
            safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as original:
        assert set(written.keys()) == set(original.keys())
        assert saved in set(written.keys())
        assert all(torch.equal(written.get_tensor(k), original.get_tensor(k)) for k in original.keys())
    model = resident_model(cfg, init=False)
    model.load_hf_state_dict(state)


@pytest.mark.parametrize("edit,window", [({}, None), ({"use_sliding_window": True, "sliding_window": 4096}, 4096)])
def test_a_qwen3_moe_window_slides_on_every_layer(edit, window):
    """Unlike Qwen2's, transformers' Qwen3-MoE window needs no max_window_layers: use_sliding_window puts it on
    every layer (the published file's max_window_layers 48 of 48 changes nothing)."""
    raw = {**Qwen3MoeConfig.example().to_hf(), "max_window_layers": 2, **edit}
    assert transformers.AutoConfig.for_model(**raw).sliding_window == window
    assert Qwen3MoeConfig.from_hf(raw).sliding_window == window
