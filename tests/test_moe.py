"""What is the mixture-of-experts families' own (tests/test_families.py holds each against transformers by its
example): the published shapes' parameter counts, their planned FLOPs and elementwise work (the active experts'),
an expert no token chose stepped as torch's AdamW steps it, data parallel with an expert that only one rank's
tokens chose, the device peak whatever the routing, the experts' matmuls (per expert or torch._grouped_mm's),
transformers' files with their experts one tensor each, the router's load-balancing loss (`output_router_logits`)
against transformers' resident and streamed, and LoRA on the experts against PEFT's `target_parameters` (its
keys, logits, gradients and steps; the planner's bytes are tests/test_lora.py's, PEFT loading the export
tests/test_families.py's)."""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers

from layers import (FAMILIES, PRESETS, ConfigError, MixtralConfig, ModelConfig, OlmoeConfig, Qwen3MoeConfig,
                    resident_model)
from layers.llama.config import LlamaConfig
from layers.lora import add_adapters
from layers.model import family_units
from layers.moe.units import GroupedLinear, SparseMoe
from memory_model import DEVICE_PRESETS, PlanConfig, plan
from memory_model.kernels import KernelCosts, gpu_elementwise_bytes
from memory_model.lora import LoraConfig
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.calibrate import CalibrationSizes, probe_shape
from streamer.calibration.dryrun import dry_run
from streamer.io.data import load_dataset
from streamer.io.tokenizer import load_tokenizer
from streamer.runtime.lora import Adapters
from streamer.runtime.optim import OptimizerConfig
from tests.test_distributed import CFG as DATA_PARALLEL_CFG, run_data_parallel, single_process
from tests.test_families import (assert_planner_dry_run_and_real_run_agree,
                                 assert_streamed_training_equals_transformers,
                                 assert_the_cli_trains_a_transformers_folder,
                                 byte_test_settings, for_cli, hf_model, planned_peak)
from tests.test_cli import run_cli
from tests.test_runtime import (
    EAGER_EXPERTS, assert_led_by_rounding_within_adam_steps, hf_fp32_noise, hf_reference, led_error,
)

# Every registered mixture of experts: the families whose blocks have experts.
MIXTURES = [model_type for model_type, cls in FAMILIES.items() if cls.example().params().experts()]


def transformers_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    return sum(p.numel() for p in model.parameters())


def test_presets_have_transformers_parameter_counts():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B of them a token's (attention, the router, 8 of 128 experts);
    Mixtral-8x7B: 46.7B; OLMoE-1B-7B: 6.9B."""
    cfg = PRESETS["qwen3-30b-a3b"]
    assert cfg.num_params() == transformers_count(cfg) == 30_532_122_624
    params = cfg.params()
    active = params.embed() + params.head() + cfg.num_hidden_layers * (
        params.block() - params.mlp() + cfg.costs().mlp.matmul_params())
    assert 3.3e9 < active < 3.4e9
    assert PRESETS["mixtral-8x7b"].num_params() == transformers_count(PRESETS["mixtral-8x7b"]) == 46_702_792_704
    assert PRESETS["olmoe-1b-7b"].num_params() == transformers_count(PRESETS["olmoe-1b-7b"]) == 6_919_161_856


def transformers_matmul_params(cfg: ModelConfig) -> int:
    """The weights a token's matmuls go through in transformers' model, counted apart from ours: every matrix
    but the embedding's (a gather), the fused experts' k of E, none of the norms' vectors."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    embedding = model.get_input_embeddings().weight
    share = cfg.num_experts_per_tok / cfg.sparse_mlp.num_experts
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
                           "intermediate_size": cfg.num_experts_per_tok * cfg.sparse_mlp.width})
    costs = KernelCosts(**{f.name: 1.0 for f in dataclasses.fields(KernelCosts)})
    for phase in ("forward", "backward"):
        assert gpu_elementwise_bytes(cfg, "block.0", phase, 2, 256, 2) == \
            gpu_elementwise_bytes(dense, "block.0", phase, 2, 256, 2)
    assert costs.forward_s(cfg, "block.0", 2, 256) == costs.forward_s(dense, "block.0", 2, 256)
    assert costs.backward_s(cfg, "block.0", 2, 256) == costs.backward_s(dense, "block.0", 2, 256)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_a_calibration_probe_keeps_the_experts_in_proportion(preset: str):
    """The kernel-cost probe is the planned model narrowed: its experts narrow with it (Qwen3-MoE's width is
    moe_intermediate_size, which generic code's intermediate_size does not name)."""
    cfg = PRESETS[preset]
    probe = probe_shape(cfg, CalibrationSizes())
    assert probe.hidden_size < cfg.hidden_size
    assert probe.sparse_mlp.num_experts == cfg.sparse_mlp.num_experts
    assert probe.sparse_mlp.width * cfg.hidden_size == cfg.sparse_mlp.width * probe.hidden_size
    assert probe.costs().active_mlp_width() * cfg.hidden_size == cfg.costs().active_mlp_width() * probe.hidden_size


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
    noise = hf_fp32_noise(start, steps, tc, exact, cfg)
    assert led_error(ours, exact[0], noise.led) <= 2 * noise.weights
    assert_led_by_rounding_within_adam_steps(ours, start, noise.led, tc, len(steps))
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
    routed = list(zip(*(experts_chosen(cfg, start, ids) for ids in rows), strict=True))
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
    assert all(len(experts) == cfg.sparse_mlp.num_experts for experts in experts_chosen(cfg, spread, ids))
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
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert torch.count_nonzero(grads[1][1]) == 0


@pytest.fixture
def grouped_mm_calls(monkeypatch) -> list[int]:
    """torch._grouped_mm serving the CPU, as it serves CUDA, and its calls from GroupedLinear counted (not
    transformers'): the kernel path, tested here (its CPU kernel takes fp32 and bf16), is what a GPU runs."""
    import sys

    import layers.moe.units as units
    calls = []
    kernel = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.extend([1] if sys._getframe(1).f_globals["__name__"] == units.__name__ else [])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(units, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_mm_kernel_computes_what_the_loop_does(grouped_mm_calls: list[int], dtype: torch.dtype):
    """torch._grouped_mm's forward and both gradients equal the per-expert loop's within the dtype's matmul
    rounding, the weight's gradient exactly zero for the experts with no rows; no rows at all, and a LoRA B's
    strided columns, which its CUDA kernels do not take, go through the loop."""
    import layers.moe.units as units
    g = torch.Generator().manual_seed(0)
    sizes = [5, 0, 9, 2, 0, 16]
    x = torch.randn(sum(sizes), 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(sizes), 8, 16, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(sum(sizes), 8, generator=g).to(dtype)

    def products(devices: set[str]) -> tuple[torch.Tensor, ...]:
        units.GROUPED_MM_DEVICES = devices
        out = GroupedLinear.apply(x, w, sizes)
        return (out, *torch.autograd.grad(out, (x, w), upstream))

    loop = products(set())
    assert not grouped_mm_calls
    grouped = products({"cpu"})
    assert len(grouped_mm_calls) == 3  # the forward, the input's gradient and the weight's
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.count_nonzero(grouped[2][[1, 4]]) == 0
    no_rows = GroupedLinear.apply(x[:0], w, [0] * len(sizes))  # a group no token chose: the loop, zeros
    assert not torch.autograd.grad(no_rows, w, upstream[:0])[0].any() and len(grouped_mm_calls) == 3
    strided = torch.randn(8, 2 * len(sizes), generator=g).to(dtype).view(8, 2, len(sizes)).permute(2, 0, 1)
    assert not units.grouped_mm_serves(x, strided) and units.grouped_mm_serves(x, w)


@pytest.mark.parametrize("model_type", MIXTURES)
def test_streamed_training_through_the_grouped_mm_kernel_equals_transformers(tmp_path: Path, grouped_mm_calls,
                                                                            model_type: str):
    """Three streamed steps with every expert matmul torch._grouped_mm's: transformers' class and torch's AdamW
    within twice transformers' own fp32 error, as the loop is held in tests/test_families.py."""
    assert_streamed_training_equals_transformers(tmp_path, FAMILIES[model_type].example())
    assert grouped_mm_calls


@pytest.mark.parametrize("model_type", MIXTURES)
def test_streamed_training_with_the_update_on_the_host_equals_transformers(tmp_path: Path, model_type: str):
    """The update's other place (tests/test_families.py runs it on the device): AdamW on the host's copy of
    each unit's state, the experts' fused tensors among them, as torch's AdamW steps transformers' class."""
    assert_streamed_training_equals_transformers(tmp_path, FAMILIES[model_type].example(), update_on="host")


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
    raw = {**Qwen3MoeConfig.example().adapter().to_hf(), "max_window_layers": 2, **edit}
    assert transformers.AutoConfig.for_model(**raw).sliding_window == window
    assert Qwen3MoeConfig.from_hf(raw).sliding_window == window


# --- the router's load-balancing loss -------------------------------------------------------------------------
def balanced(cfg: ModelConfig) -> ModelConfig:
    """cfg asking for the load-balancing loss, at a coefficient no family defaults to and large enough that its
    gradient moves every weight beyond fp32 noise."""
    return dataclasses.replace(cfg, output_router_logits=True, router_aux_loss_coef=0.25)


def test_the_loss_is_asked_for_as_transformers_reads_it():
    """output_router_logits and router_aux_loss_coef from a published file; without output_router_logits
    transformers never reads the coefficient, and the model has no auxiliary loss and no bytes for one."""
    raw = Qwen3MoeConfig.example().adapter().to_hf()
    asked = ModelConfig.from_hf({**raw, "output_router_logits": True, "router_aux_loss_coef": 0.5})
    assert (asked.output_router_logits, asked.router_aux_loss_coef) == (True, 0.5)
    assert ModelConfig.from_hf(asked.adapter().to_hf()) == asked
    assert asked.costs().auxiliary_loss_bytes() == 2 * 4 * asked.sparse_mlp.num_experts
    plain = ModelConfig.from_hf({**raw, "router_aux_loss_coef": 0.5})
    assert plain == Qwen3MoeConfig.example() and plain.costs().auxiliary_loss_bytes() == 0
    assert family_units(plain).auxiliary(plain, 1.0, torch.device("cpu"), None) is None
    with pytest.raises(ConfigError, match="router_aux_loss_coef must be a finite number, got 'x'"):
        ModelConfig.from_hf({**raw, "output_router_logits": True, "router_aux_loss_coef": "x"})


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("model_type", MIXTURES)
def test_the_load_balancing_loss_and_its_gradients_equal_transformers(model_type: str, padded: bool):
    """The resident model's loss (cross-entropy plus the coefficient times the load-balancing loss) and every
    parameter's gradient against transformers' `loss` in float64, within twice transformers' own fp32 error (its
    eager and sdpa kernels); the loss's share is the coefficient times transformers' `aux_loss`. `padded`: the
    second row ends in padding (unlearned), which transformers' attention mask leaves out of the balance."""
    cfg = balanced(FAMILIES[model_type].example())
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    if padded:
        mask[1, 15:] = False
    labels = ids.masked_fill(~mask, -100)
    given = {"attention_mask": mask.long()} if padded else {}

    def run(model: torch.nn.Module, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = loss_of(model)
        loss.backward()
        return loss.detach().double(), {k: p.grad.double() for k, p in model.named_parameters()}

    exact_model = hf_model(cfg, torch.float64)
    exact = run(exact_model, lambda m: m(ids, labels=labels, **given).loss)
    noise = [run(hf_model(cfg, attn=attn), lambda m: m(ids, labels=labels, **given).loss) for attn in ("eager", "sdpa")]
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(hf_model(cfg).state_dict())
    mine = run(ours, lambda m: m.loss(ids, labels, attention_mask=mask if padded else None))
    with torch.no_grad():
        share = cfg.router_aux_loss_coef * exact_model(ids, **given).aux_loss
        unbalanced = exact[0] - share
        if padded:  # the padding counted is another number
            counted = cfg.router_aux_loss_coef * exact_model(ids).aux_loss
            assert (counted - share).abs() > 1e-3
    assert share > 0.1  # the term is large enough that a wrong one shows
    bound = max((n[0] - exact[0]).abs().item() for n in noise)
    rounding = exact[0].abs().item() * torch.finfo(torch.float32).eps  # where transformers' own is exact
    assert (mine[0] - exact[0]).abs().item() <= max(2 * bound, 4 * rounding)
    assert (mine[0] - unbalanced).abs() > 0.1
    for k in exact[1]:
        bound = max((n[1][k] - exact[1][k]).abs().max().item() for n in noise)
        # The balance's gradient joins the router's in a fused add of its own: fp32's rounding of the tensor's
        # largest element is the floor, as for the loss (transformers' own error can be smaller by chance).
        rounding = exact[1][k].abs().max().item() * torch.finfo(torch.float32).eps
        assert (mine[1][k] - exact[1][k]).abs().max().item() <= max(2 * bound, 4 * rounding), k


@pytest.mark.parametrize("activations", ["resident", "checkpoint"])
@pytest.mark.parametrize("model_type", MIXTURES)
def test_streamed_training_with_the_load_balancing_loss_equals_transformers(tmp_path: Path, model_type: str,
                                                                            activations: str):
    """Three streamed steps of two micro-batches against transformers' class (its loss with the load-balancing
    term, each micro-batch's own, as Trainer adds it: not divided by the micro-batches where the cross-entropy
    is over the step's tokens) and torch's AdamW, within twice transformers' own fp32 error; the reported losses
    are transformers' (cross-entropy and balance). Checkpointed, each block's forward runs again in its
    backward and must not count its routing twice."""
    cfg = balanced(FAMILIES[model_type].example())
    run = assert_streamed_training_equals_transformers(tmp_path, cfg, activations=activations)
    unbalanced = hf_reference(run.start, run.steps, run.tc, dataclasses.replace(cfg, output_router_logits=False))
    assert max((unbalanced[0][k] - run.exact[k]).abs().max().item() for k in run.exact) > 100 * run.noise


@pytest.mark.parametrize("model_type", MIXTURES)
@pytest.mark.parametrize("dtype,activations,store,lora", [("fp32", "resident", "ram", 0),
                                                          ("bf16", "checkpoint", "disk", 0),
                                                          ("bf16", "resident", "ram", 4)])
def test_the_planner_prices_the_load_balance_to_the_byte(tmp_path: Path, model_type: str, dtype: str,
                                                         activations: str, store: str, lora: int):
    """The balance's sums, charged to the first block from its forward to its backward: planner = ledger = dry
    run, as tests/test_families.py holds every family's example."""
    cfg = FAMILIES[model_type].example()
    assert_planner_dry_run_and_real_run_agree(tmp_path, balanced(cfg), dtype, activations, store, lora)
    tc = byte_test_settings(cfg, dtype, activations, store, lora)
    sums = 2 * 4 * cfg.sparse_mlp.num_experts  # the balance's sums, fp32
    assert planned_peak(balanced(cfg), tc) - planned_peak(cfg, tc) == sums


@pytest.mark.parametrize("model_type", MIXTURES)
def test_the_cli_trains_a_transformers_folder_that_asks_for_the_balance(capsys, tmp_path: Path, tiny_setup: Path,
                                                                        model_type: str):
    """`streamer train --from-pretrained` on a folder whose config.json asks for the load-balancing loss; the
    export asks for it too, and is transformers' model of our weights."""
    cfg = balanced(for_cli(model_type))
    assert_the_cli_trains_a_transformers_folder(capsys, tmp_path, tiny_setup, cfg)
    assert ModelConfig.from_hf(tmp_path / "out") == cfg


@pytest.mark.parametrize("model_type", MIXTURES)
def test_the_cli_leaves_padding_out_of_the_balance_as_transformers_does(capsys, tmp_path: Path, tiny_setup: Path,
                                                                       model_type: str):
    """`streamer train` on prompt/completion examples, one to a padded sequence or packed, at two --seq: step 1's
    loss and gradient norm are transformers' given the attention mask (the balance over the examples' tokens,
    none of the padding), within twice transformers' own fp32 error (its eager and sdpa kernels)."""
    cfg = balanced(for_cli(model_type))
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    words = (tiny_setup / "train.txt").read_text().split()
    examples = [{"prompt": " ".join(words[9 * i:9 * i + 2 + i // 2]),
                 "completion": " " + " ".join(words[200 + i:201 + 2 * i])} for i in range(6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in examples))
    tokenizer = load_tokenizer(tiny_setup / "tok")
    rows = load_dataset(data, tokenizer, 48)
    assert len(rows) == 6 and rows.truncated == 0 and not rows.attention_mask.all()  # each example whole, padded

    def hf_step(dtype: torch.dtype, attn: str, mask: bool = True) -> tuple[float, float]:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype,
                                                                  attn_implementation=attn, **EAGER_EXPERTS)
        loss = model(rows.input_ids, attention_mask=rows.attention_mask.long() if mask else None,
                     labels=rows.labels).loss
        loss.backward()
        return loss.item(), torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()

    exact = hf_step(torch.float64, "eager")
    noise = [max(abs(a - b) for a, b in zip(hf_step(torch.float32, attn), exact, strict=True))
             for attn in ("eager", "sdpa")]
    bound = max(2 * max(noise), 4 * torch.finfo(torch.float32).eps * max(exact))
    counted = hf_step(torch.float64, "eager", mask=False)  # the padding in the balance: another number
    assert abs(counted[0] - exact[0]) > 100 * bound
    for seq, pack in itertools.product((48, 64), ([], ["--pack"])):
        run = tmp_path / f"run-{seq}{'-packed' if pack else ''}"
        batch = len(load_dataset(data, tokenizer, seq, pack="examples" if pack else None))
        rc, _, err = run_cli(capsys, "train", "--from-pretrained", tmp_path / "hf", "--tokenizer", tiny_setup / "tok",
                             "--data", data, *pack, "--run-dir", run, "--steps", 1, "--batch", batch, "--seq", seq,
                             "--dtype", "fp32", "--store", "ram", "--eval-fraction", 0, "--sample-tokens", 0)
        assert rc == 0, err
        record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        assert abs(record["loss"] - exact[0]) <= bound, (seq, pack)
        assert abs(record["grad_norm"] - exact[1]) <= bound, (seq, pack)


@pytest.mark.slow
def test_two_gloo_ranks_sum_their_load_balancing_losses_as_trainer_does(tmp_path: Path):
    """Each rank's balance is over its own rows, and the all-reduce sums the ranks' (Trainer scales each rank's
    loss by the processes and DDP averages): two ranks of two rows are one process of two micro-batches."""
    cfg = balanced(Qwen3MoeConfig.example().resized(vocab_size=DATA_PARALLEL_CFG.vocab_size))  # its batches' tokens
    tc = TrainerConfig.of(lr=1e-3, dtype="fp32", store="disk", max_grad_norm=1.0, update_chunk=10_000)
    ranks = run_data_parallel(tmp_path, [("new", 3)], tc, cfg)
    reference = single_process(tmp_path, 3, tc, cfg)
    assert max((ranks[0]["state"][k] - reference["state"][k]).abs().max().item() for k in reference["state"]) <= 1e-5
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=2e-6)


# --- LoRA on the experts, as PEFT's target_parameters puts it ------------------------------------------------------
EXPERT_TARGETS = "q_proj,experts.gate_up_proj,experts.down_proj"  # a Linear too: PEFT nests and keys them apart


def _peft(cfg: ModelConfig, targets: str, dtype: torch.dtype = torch.float32, attn: str = "eager"):
    """PEFT's LoRA (rank 4, alpha 8) on transformers' model of cfg, the Linear targets as modules and the experts'
    tensors as parameters."""
    peft = pytest.importorskip("peft")
    names = targets.split(",")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[t for t in names if t not in cfg.lora().parameters],
                             target_parameters=[t for t in names if t in cfg.lora().parameters])
    return peft.get_peft_model(hf_model(cfg, dtype, attn), config)


def _adapters_of(model) -> dict[str, torch.nn.Parameter]:
    """PEFT's trainable tensors by the keys its save_pretrained writes."""
    return {k.replace(".default", ""): p for k, p in model.named_parameters() if p.requires_grad}


def _random_adapters(cfg: ModelConfig, targets: str) -> dict[str, torch.Tensor]:
    """Adapters of unit scale under PEFT's keys (B too: PEFT's zero B would hide A's gradient and the delta)."""
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
            for k, p in sorted(_adapters_of(_peft(cfg, targets)).items())}


def _set(tensors: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in tensors.items():
            t.copy_(values[k])


MOE = [Qwen3MoeConfig, MixtralConfig, OlmoeConfig]


@pytest.mark.parametrize("family", MOE, ids=lambda c: c.model_type)
@pytest.mark.parametrize("targets", ["experts.gate_up_proj", "experts.down_proj", EXPERT_TARGETS])
def test_expert_adapters_have_peft_keys_shapes_and_initialisation(family, targets: str):
    """The adapters the runtime keeps, under the keys and shapes PEFT saves for the same targets (an expert tensor's
    A is r E x in, its B out x r E; a second tensor of the experts module nests the first's one `base_layer`
    deeper); A drawn as nn.Linear's (kaiming uniform over in_features) and B zero, PEFT's initialisation."""
    cfg = family.example()
    theirs = pytest.importorskip("peft").get_peft_model_state_dict(_peft(cfg, targets))
    adapters = Adapters(cfg, LoraConfig(rank=4, alpha=8.0, targets=targets), OptimizerConfig(), torch.device("cpu"), 0)
    ours = adapters.hf_state_dict({unit: cfg.adapter().prefix(unit) for unit in cfg.unit_names()})
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    for key, value in ours.items():
        if ".lora_B." in key:
            assert torch.count_nonzero(value) == 0
        else:  # kaiming_uniform(a=sqrt(5)) over in_features is uniform in +-1/sqrt(in): PEFT's bound, the same spread
            bound = 1 / value.shape[1] ** 0.5
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound
            assert value.std() > 0.5 * bound / 3 ** 0.5


@pytest.mark.parametrize("family", MOE, ids=lambda c: c.model_type)
def test_expert_adapters_give_peft_logits_and_gradients(family):
    """Our block with adapters on every expert (two rank-r grouped matmuls on the routed rows) against PEFT's
    ParamWrapper on transformers' model (W_e + scaling B_e A_e folded into the weight) in float64: the logits and
    every adapter's gradient within twice transformers' fp32 noise with PEFT (its eager and sdpa kernels). A
    gradient's noise is the largest over every adapter, relative to its gradient's size: one tensor's own is one
    sample. Under AVX2 on an AMD EPYC, OLMoE's layer-1 q_proj B was 9.9e-8 from float64 (1.4e-6 of its largest
    gradient), its own transformers noise 4.1e-8, and the model's largest relative noise 2.1e-6."""
    cfg = family.example()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    start = _random_adapters(cfg, EXPERT_TARGETS)

    def run(forward, leaves: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _set(leaves, start)
        logits = forward()
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()).backward()
        return logits.detach().double(), {k: p.grad.double() for k, p in leaves.items()}

    def peft_run(dtype: torch.dtype, attn: str):
        model = _peft(cfg, EXPERT_TARGETS, dtype, attn)
        return run(lambda: model(input_ids=ids).logits, _adapters_of(model))

    exact, noise = peft_run(torch.float64, "eager"), [peft_run(torch.float32, attn) for attn in ("eager", "sdpa")]
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(hf_model(cfg).state_dict())
    ours.requires_grad_(False)
    targets = tuple(EXPERT_TARGETS.split(","))
    leaves = {}
    for i, block in enumerate(ours.model.layers):
        add_adapters(block, targets, 4, 2.0, 0.0)
        for keys in (cfg.lora().keys(target, targets) for target in targets):
            for mine, theirs in ((keys.a, keys.peft_a), (keys.b, keys.peft_b)):
                leaves[f"base_model.model.{cfg.adapter().prefix(f'block.{i}')}{theirs}"] = block.get_parameter(mine)
    assert set(leaves) == set(start)
    mine = run(lambda: ours(ids), {k: p.requires_grad_() for k, p in leaves.items()})
    assert exact[0].abs().max() > 1.0 and (exact[0] - hf_model(cfg, torch.float64)(ids).logits).abs().max() > 0.1
    bound = max((n[0] - exact[0]).abs().max().item() for n in noise)
    assert (mine[0] - exact[0]).abs().max().item() <= 2 * bound  # measured about 0.9x
    size = {k: g.abs().max().item() for k, g in exact[1].items()}
    relative = max((n[1][k] - exact[1][k]).abs().max().item() / size[k] for n in noise for k in exact[1])
    for k in exact[1]:
        assert (mine[1][k] - exact[1][k]).abs().max().item() <= 2 * relative * size[k], k


def _peft_steps(cfg: ModelConfig, base: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                steps: list[torch.Tensor], tc: TrainerConfig, dtype: torch.dtype, attn: str):
    """PEFT on transformers' model with torch's AdamW on the adapters, clipped by their norm, two micro-batches a
    step each summing its loss over the step's learned tokens (HF Trainer's num_items_in_batch); the adapters after
    the steps, and the losses."""
    model = _peft(cfg, EXPERT_TARGETS, dtype, attn)
    model.base_model.model.load_state_dict({k: v.to(dtype) for k, v in base.items()}, strict=False)
    leaves = _adapters_of(model)
    _set(leaves, start)
    opt = tc.optimizer
    optimizer = torch.optim.AdamW(leaves.values(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    losses = []
    for ids in steps:
        optimizer.zero_grad()
        tokens, loss = torch.tensor(ids[:, 1:].numel()), 0.0
        for micro in ids.chunk(tc.step.grad_accum):
            part = model(input_ids=micro, labels=micro, num_items_in_batch=tokens).loss
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(leaves.values(), opt.max_grad_norm)
        optimizer.step()
        losses.append(loss)
    return {k: p.detach().double() for k, p in leaves.items()}, losses


@pytest.mark.parametrize("family", MOE, ids=lambda c: c.model_type)
def test_a_streamed_lora_step_on_the_experts_is_peft_and_adamw(tmp_path: Path, family):
    """Two streamed steps with adapters on attention's q and every expert (two micro-batches, clipped, decayed)
    against PEFT on transformers' model with torch's AdamW in float64: the adapters within twice PEFT's own fp32
    error on the same steps, the base never written."""
    cfg = family.example()
    tc = TrainerConfig.of(dtype="fp32", lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, grad_accum=2, store="ram",
                          lora_rank=4, lora_alpha=8.0, lora_targets=EXPERT_TARGETS)
    g = torch.Generator().manual_seed(2)
    steps = [torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2)]
    base, start = hf_model(cfg).state_dict(), _random_adapters(cfg, EXPERT_TARGETS)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(base)
        prefixes = {unit: cfg.adapter().prefix(unit) for unit in trainer.units}
        with torch.no_grad():
            for unit, tensors in trainer.adapters.params.items():
                for keys in trainer.adapters.keys.values():
                    tensors[keys.a].copy_(start[f"base_model.model.{prefixes[unit]}{keys.peft_a}"])
                    tensors[keys.b].copy_(start[f"base_model.model.{prefixes[unit]}{keys.peft_b}"])
        losses = [trainer.step(ids) for ids in steps]
        ours = {k: v.double() for k, v in trainer.adapters.hf_state_dict(prefixes).items()}
        assert all(torch.equal(v, base[k]) for k, v in trainer.state_dict(merged=False).items())
    exact = _peft_steps(cfg, base, start, steps, tc, torch.float64, "eager")
    noise = [_peft_steps(cfg, base, start, steps, tc, torch.float32, attn) for attn in ("eager", "sdpa")]
    assert set(ours) == set(exact[0])
    assert max((exact[0][k] - start[k]).abs().max().item() for k in start) > 1e-3  # the steps moved them
    bound = max(max((n[0][k] - exact[0][k]).abs().max().item() for k in start) for n in noise)
    assert max((ours[k] - exact[0][k]).abs().max().item() for k in start) <= 2 * bound  # measured 0.4x to 1.1x
    bound = max(max(abs(a - b) for a, b in zip(n[1], exact[1], strict=True)) for n in noise)
    rounding = max(exact[1]) * torch.finfo(torch.float32).eps
    assert max(abs(a - b) for a, b in zip(losses, exact[1], strict=True)) <= max(2 * bound, 4 * rounding)


def test_dropout_before_the_experts_adapters_is_refused(tmp_path: Path):
    """PEFT's ParamWrapper takes no dropout (a weight tensor's input is not its adapters' own): refused in one line
    naming the flag."""
    tc = TrainerConfig.of(lora_rank=4, lora_dropout=0.1, lora_targets="q_proj,experts.down_proj")
    with pytest.raises(ValueError, match=r"^--lora-dropout must be 0 with adapters on experts.down_proj \(PEFT's LoRA "
                                         r"on a weight tensor takes no dropout\), got 0.1$"):
        StreamingTrainer(Qwen3MoeConfig.example(), tc, store_dir=tmp_path / "run")
