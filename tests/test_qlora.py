"""QLoRA: LoRA on a 4-bit streamed base. The import quantizes as bitsandbytes does, byte for byte; the loss and every
adapter's gradient, and three streamed steps, against transformers' 4-bit model (BitsAndBytesConfig) with PEFT's
LoRA, within twice that model's own fp32 error; the planner equal to the ledger and the dry run; the flags."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from layers import FAMILIES, PRESETS
from layers.packed4 import unit_bytes
from memory_model import device_spec, format_size, plan
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run
from streamer.cli.generate import open_trainer
from streamer.cli.main import main
from streamer.run_dir import RunDir
from streamer.store.slabfile import TRAILER_BYTES
from tests.test_families import hf_model
from tests.test_runtime import EAGER_EXPERTS

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

CFG = FAMILIES["llama"].example()  # q/k/v and MLP biases: every kind of tensor a block holds
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0


def _settings(quant_type: str, double_quant: bool, **more: object) -> TrainerConfig:
    settings = {"dtype": "fp32", "store": "ram", **more}
    return TrainerConfig.of(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(TARGETS), load_in_4bit=True,
                            bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant, **settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    hf_model(CFG).save_pretrained(folder)
    return folder


def _adapters(trainer: StreamingTrainer, seed: int = 5) -> dict[str, torch.Tensor]:
    """The trainer's adapters set to random values (B too, so every adapter matters), by PEFT's keys."""
    torch.manual_seed(seed)
    for tensors in trainer.adapters.params.values():
        for t in tensors.values():
            t.data.normal_(0, 0.1)
    prefix = {f"block.{i}": f"model.layers.{i}." for i in range(CFG.num_hidden_layers)}
    return {k: v.clone() for k, v in trainer.adapters.hf_state_dict(prefix).items()}  # (views of the trainer's)


def _peft(base: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                                                      lora_dropout=0.0))
    assert not peft.set_peft_model_state_dict(model, adapters).unexpected_keys
    return model


def _bnb_model(folder: Path, quant_type: str, double_quant: bool, attn: str) -> torch.nn.Module:
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                             bnb_4bit_use_double_quant=double_quant,
                                             bnb_4bit_compute_dtype=torch.float32)
    # In training mode: in eval mode on a CPU, bitsandbytes repacks the weights for its inference kernel.
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32,
                                                             device_map="cpu", attn_implementation=attn,
                                                             **EAGER_EXPERTS).train()


def _dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The 4-bit model's weights as bitsandbytes dequantizes them: the function it computes, in float64."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[f"{name}.weight"] = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias.data
    for name, param in model.named_parameters():
        out.setdefault(name, param.data)
    return {k: v.double() for k, v in out.items()}


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten())
    loss.backward()
    grads = {_our_key(k): p.grad.double() for k, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def peft_adamw_steps(model: torch.nn.Module, batches: list[torch.Tensor], tc: TrainerConfig, dtype: torch.dtype,
                     nudge: dict[str, float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PEFT's model trained as a streamed run of `tc` trains: each batch two micro-batches of the token-mean loss,
    the gradient clipped to tc's norm, torch's AdamW; the losses and the adapters after, by our keys. `nudge`: an
    amount added to each adapter's gradient (by our key) before clipping, at every step, in every element that has
    one (an element no row reaches, an expert's that no token chose, has none in any order of the sums)."""
    model = model.to(dtype) if dtype == torch.float64 else model
    named = [(_our_key(k), p) for k, p in model.named_parameters() if p.requires_grad]
    leaves = [p for _, p in named]
    opt = tc.optimizer
    adamw = torch.optim.AdamW(leaves, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    out = []
    for ids in batches:
        adamw.zero_grad()
        tokens = ids[:, 1:].numel()
        total = 0.0
        for micro in ids.chunk(2):
            logits = model(input_ids=micro).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).to(dtype), micro[:, 1:].flatten(),
                                   reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        for key, p in named if nudge else ():
            p.grad.add_(p.grad.ne(0) * nudge[key])
        torch.nn.utils.clip_grad_norm_(leaves, opt.max_grad_norm)
        adamw.step()
        out.append(total)
    return out, {key: p.detach().double() for key, p in named}


def _our_key(peft_name: str) -> str:
    """A PEFT model's parameter name as our adapters' keys name it."""
    return peft_name.replace(".default", "").replace("base_model.model.", "")


def assert_adamw_steps_within_noise(ours: dict[str, torch.Tensor], losses: list[float],
                                    exact_model: Callable[[], torch.nn.Module], references: list[torch.nn.Module],
                                    batches: list[torch.Tensor], tc: TrainerConfig) -> None:
    """`ours`, the adapters (by our keys) after a streamed run of `tc` over `batches`, and its `losses`, against
    PEFT's model trained as that run trains (`peft_adamw_steps`) in float64 (`exact_model()`, a fresh one each
    call), within twice their fp32 noise, measured on `references` (the 4-bit model in fp32, eager and sdpa):
    each loss within twice theirs; each adapter's element within twice what AdamW makes of their fp32 gradient
    noise in that element (`amplified`) plus twice the rest of their error on the adapters (`rest`).

    Why by element: AdamW's first step moves an element by lr * g / (|g| + eps), whose derivative in g is
    lr * eps / (|g| + eps)^2. Where a gradient element cancels to about eps (OLMoE's example has one at -2e-8,
    -1.2e-8 once clipped, where its column's largest is 2e-3), fp32's absolute noise there (2e-10, 1% of it)
    moves the weight by 3e-5; where the gradient is 1e-3 it moves it by about 1e-9. How much noise an fp32 run
    leaves in that one element is luck of the summation order: OLMoE's is 2e-13 to 1.5e-10 over 48 orders of the
    reference (two attention kernels, every order of the batch's rows) with torch's AVX2 kernels, 5e-11 to 4.5e-10
    with its AVX-512 ones, ours 1.7e-10 to 3.6e-10 over 8 orders with either, while each tensor's largest gradient
    error is at most 1.3x the reference's. So the adapters' largest error is one draw of one element's noise, and
    two draws of the reference's bound no third (ours was 3.4x the larger with AVX2 kernels). Instead the float64
    trajectory runs again with each adapter's gradient moved by the references' largest fp32 error in that tensor
    (on the first batch), at every step and in every element that has a gradient, up and down: AdamW's
    sensitivity, element by element, to gradient noise of the size the references measure. What their own error
    on the adapters has beyond that is the rest (the weights' rounding, 2e-8 to 1e-7 in the tests' models)."""
    exact = exact_model()
    grads = _loss_and_grads(exact, batches[0])[1]
    noisy_grads = [_loss_and_grads(r, batches[0])[1] for r in references]
    gradient_noise = {k: max((n[k] - want).abs().max().item() for n in noisy_grads) for k, want in grads.items()}
    exact_losses, exact_weights = peft_adamw_steps(exact, batches, tc, torch.float64)
    noisy = [peft_adamw_steps(r, batches, tc, torch.float32) for r in references]
    nudged = [peft_adamw_steps(exact_model(), batches, tc, torch.float64,
                               {k: sign * n for k, n in gradient_noise.items()})[1] for sign in (1, -1)]
    assert set(ours) == set(exact_weights)
    amplified = {k: torch.stack([(n[k] - want).abs() for n in nudged]).amax(dim=0)
                 for k, want in exact_weights.items()}
    rest = max(((n[1][k] - want).abs() - amplified[k]).clamp(min=0).max().item()
               for n in noisy for k, want in exact_weights.items())
    for key, want in exact_weights.items():
        error, bound = (ours[key] - want).abs(), 2 * (amplified[key] + rest)
        worst = (error - bound).argmax()
        assert (error <= bound).all(), f"{key}: {error.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g}"
    loss_noise = max(abs(a - b) for n in noisy for a, b in zip(n[0], exact_losses, strict=True))
    assert max(abs(a - b) for a, b in zip(losses, exact_losses, strict=True)) <= 2 * loss_noise + 1e-6


@pytest.mark.parametrize("quant_type,double_quant,chunk", [("nf4", True, None), ("fp4", False, None),
                                                             ("nf4", True, 3 * 64), ("fp4", False, 5 * 64)])
def test_import_quantizes_as_bitsandbytes_byte_for_byte(checkpoint: Path, quant_type: str, double_quant: bool,
                                                        chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each weight as bitsandbytes quantizes it whole; also where the import quantizes it a few blocks at a time
    (`chunk`: as it does a weight of over QUANTIZE_CHUNK elements)."""
    if chunk is not None:
        monkeypatch.setattr("layers.quant4.QUANTIZE_CHUNK", chunk)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    with StreamingTrainer.from_pretrained(checkpoint, _settings(quant_type, double_quant)) as trainer:
        layout = trainer.layouts["block.1"]
        slab = trainer.store.slab("block.1", "compute")
        assert slab.dtype == torch.uint8 and slab.numel() == unit_bytes(CFG, "block.1", 4, double_quant)
        pieces = layout.packed.views(slab)
        for target in TARGETS:
            key = next(s.key for s in layout.slots if s.key.endswith(f"{target}.weight"))
            module = key.rsplit(".", 1)[0]
            packed, state = bnb.functional.quantize_4bit(hf[f"model.layers.1.{key}"], blocksize=64,
                                                         compress_statistics=double_quant, quant_type=quant_type)
            assert torch.equal(pieces[f"{module}.weight"], packed)
            assert torch.equal(pieces[f"{module}.absmax"], state.absmax)
            if double_quant:
                assert torch.equal(pieces[f"{module}.nested_absmax"], state.state2.absmax)
                assert torch.equal(pieces[f"{module}.nested_offset"], state.offset)
        norm = next(s for s in layout.slots if s.key.endswith("layernorm.weight"))
        assert torch.equal(pieces[norm.key], hf[norm.hf_key])  # the 16-bit tensors as they were


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("fp4", False)])
def test_a_mixtures_experts_quantize_as_bitsandbytes_replace_parameter_4bit(tmp_path: Path, quant_type: str,
                                                                           double_quant: bool) -> None:
    """A mixture's fused expert tensors are held as bitsandbytes' own way of quantizing a parameter
    (`replace_parameter_4bit`, one quantize_4bit of the whole tensor) gives them, byte for byte; its router as
    transformers leaves it, 16-bit; its attention as bitsandbytes' quantize_4bit of each Linear's weight."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    cfg = FAMILIES["qwen3_moe"].example()
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path)
    tc = TrainerConfig.of(dtype="fp32", store="ram", lora_rank=RANK, lora_targets=",".join(cfg.lora().projections),
                          load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant)
    with StreamingTrainer.from_pretrained(tmp_path, tc) as trainer:
        layout = trainer.layouts["block.1"]
        pieces = layout.packed.views(trainer.store.slab("block.1", "compute"))
    experts = hf.model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        replace_parameter_4bit(experts, name, compress_statistics=double_quant, quant_type=quant_type, blocksize=64)
        state = experts.parametrizations[name][0].quant_state
        ours = {k.removeprefix(f"mlp.experts.{name}").lstrip("_") or "weight": v for k, v in pieces.items()
                if k.startswith(f"mlp.experts.{name}")}
        assert torch.equal(ours.pop("weight"), experts.parametrizations[name].original)
        assert torch.equal(ours.pop("absmax"), state.absmax)
        if double_quant:
            assert torch.equal(ours.pop("nested_absmax"), state.state2.absmax)
            assert torch.equal(ours.pop("nested_offset"), state.offset)
        assert not ours
    assert torch.equal(pieces["mlp.gate.weight"], hf.state_dict()["model.layers.1.mlp.gate.weight"])
    attention = hf.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    packed, _ = bnb.functional.quantize_4bit(attention, blocksize=64, compress_statistics=double_quant,
                                             quant_type=quant_type)
    assert torch.equal(pieces["self_attn.q_proj.weight"], packed)


def test_each_expert_dequantizes_as_bitsandbytes_dequantizes_the_whole_tensor() -> None:
    """One expert's weight, dequantized from only the blocks (and nested blocks) it lies in, is its rows of
    bitsandbytes' dequantize_4bit of the whole tensor: where the experts' rows are whole blocks of 64, as in every
    published mixture, through bitsandbytes' own parametrization of the tensor; and flat, for any shape."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from layers.quant4 import Quant4

    g = torch.Generator().manual_seed(0)
    # (Experts of whole blocks across nested blocks; of whole blocks; starting inside a block.)
    for (experts, rows, columns), double_quant in (((6, 96, 128), True), ((5, 40, 24), True), ((7, 10, 24), True),
                                                   ((3, 10, 36), False)):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.randn(experts, rows, columns, generator=g))
        quant = Quant4("nf4", double_quant, torch.float32)
        pieces = quant.quantize(module.weight.data)
        replace_parameter_4bit(module, "weight", compress_statistics=double_quant, quant_type="nf4", blocksize=64)
        state = module.parametrizations["weight"][0].quant_state
        flat = bnb.functional.QuantState(absmax=state.absmax, shape=torch.Size((1, experts * rows * columns)),
                                         code=state.code, blocksize=64, quant_type="nf4", dtype=torch.float32,
                                         offset=state.offset, state2=state.state2)
        whole = bnb.functional.dequantize_4bit(module.parametrizations["weight"].original, flat)
        whole = whole.view(experts, rows, columns)
        if columns % 64 == 0:
            assert torch.equal(module.weight, whole)  # (bitsandbytes' 3D dequantization, its parametrization's)
        for e in range(experts):
            assert torch.equal(quant.dequantize_rows(pieces, (experts * rows, columns), e * rows, rows), whole[e])


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("fp4", False)])
def test_a_weight_dequantized_into_a_buffer_is_bitsandbytes_dequantize_4bit(quant_type: str,
                                                                            double_quant: bool) -> None:
    """Into a given buffer (the one a block's pass dequantizes each weight into), a weight is bit for bit
    bitsandbytes' dequantize_4bit of its pieces, in each dtype, for a row of odd length too (its own fallback)."""
    from layers.quant4 import Quant4, dequantize

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((96, 128), (40, 24), (7, 9)):
            quant = Quant4(quant_type, double_quant, dtype)
            pieces = quant.quantize(torch.randn(shape, generator=g).to(dtype))
            out = torch.full(shape, float("nan"), dtype=dtype)
            assert dequantize(pieces, shape, quant, out) is out
            assert torch.equal(out, dequantize(pieces, shape, quant)), (dtype, shape)


def _step_counting_dequantizations(checkpoint: Path, ids: torch.Tensor,
                                   into: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    """A 4-bit step's loss, its adapters' gradients and the weights bitsandbytes dequantized into tensors of
    their own; `into`: the passes' buffers as they are, else none."""
    from streamer.runtime import passes

    own = torch.ops.bitsandbytes.dequantize_4bit.default
    calls: list[object] = []
    grads: dict[str, torch.Tensor] = {}
    with StreamingTrainer.from_pretrained(checkpoint, _settings("nf4", True)) as trainer, \
            pytest.MonkeyPatch.context() as mp:
        _adapters(trainer)
        if not into:
            mp.setattr(passes, "dequantized_into", lambda buffer: contextlib.nullcontext())
        mp.setattr(torch.ops.bitsandbytes.dequantize_4bit, "default", lambda *args: calls.append(args) or own(*args))
        original = trainer.adapters.step

        def capture(lr: float, clip: float) -> None:
            grads.update({f"{unit}.{key}": t.grad.clone() for unit, tensors in trainer.adapters.params.items()
                          for key, t in tensors.items()})
            original(lr, clip)

        mp.setattr(trainer.adapters, "step", capture)
        loss = trainer.step(ids)
    return loss, grads, len(calls)


def test_a_4bit_step_dequantizes_every_weight_into_its_passs_buffer(checkpoint: Path) -> None:
    """Every weight a 4-bit block's forward and backward dequantize goes into the buffer of its pass: none into a
    tensor of its own (each of those a fresh mapping to fault in, on the host), and the step's loss and adapters'
    gradients are those of dequantizing each into its own."""
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    loss, grads, into_own = _step_counting_dequantizations(checkpoint, ids, into=True)
    loss_own, grads_own, each_own = _step_counting_dequantizations(checkpoint, ids, into=False)
    assert into_own == 0 and each_own > len(TARGETS) * CFG.num_hidden_layers  # (forward and backward)
    assert loss == loss_own and grads.keys() == grads_own.keys() and grads
    assert all(torch.equal(grads[k], grads_own[k]) for k in grads)


def assert_lora_gradients_within_noise(checkpoint: Path, tc: TrainerConfig,
                                       quantized: Callable[[str], torch.nn.Module],
                                       dequantized: Callable[[torch.nn.Module], dict[str, torch.Tensor]]) -> None:
    """Our loss and every adapter's gradient on a step of `tc` against transformers' quantized model + PEFT
    (`quantized(attention)`), held against the same dequantized model in float64: within twice the quantized
    model's own fp32 error (its eager and sdpa kernels)."""
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with StreamingTrainer.from_pretrained(checkpoint, tc) as trainer:
        adapters = _adapters(trainer)
        seen = {}
        original = trainer.adapters.step

        def capture(lr: float, clip: float) -> None:
            for unit, tensors in trainer.adapters.params.items():
                for key, t in tensors.items():
                    seen[f"model.layers.{unit.split('.')[1]}.{key}"] = t.grad.double().clone()
            original(lr, clip)

        trainer.adapters.step = capture
        loss = trainer.step(ids)
    noisy = [_loss_and_grads(_peft(quantized(attn), adapters), ids) for attn in ("eager", "sdpa")]
    exact_base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    exact_base.load_state_dict(dequantized(quantized("eager")))
    exact = _loss_and_grads(_peft(exact_base, {k: v.double() for k, v in adapters.items()}), ids)
    assert set(seen) == set(exact[1]) and len(seen) == 2 * len(TARGETS) * CFG.num_hidden_layers
    assert abs(loss - exact[0]) <= 2 * max(abs(n[0] - exact[0]) for n in noisy) + 1e-6
    for key, grad in exact[1].items():
        assert grad.abs().max() > 0
        bound = max((n[1][key] - grad).abs().max().item() for n in noisy)
        assert (seen[key] - grad).abs().max().item() <= 2 * bound, key


def test_lora_gradients_equal_transformers_4bit_with_peft_within_its_fp32_noise(checkpoint: Path) -> None:
    """The loss and every adapter's gradient against transformers' 4-bit model + PEFT, within twice its own fp32
    error against the dequantized model in float64."""
    assert_lora_gradients_within_noise(checkpoint, _settings("nf4", True, max_grad_norm=0.0),
                                       lambda attn: _bnb_model(checkpoint, "nf4", True, attn), _dequantized)


def test_three_streamed_steps_equal_peft_on_the_4bit_model_with_adamw(checkpoint: Path) -> None:
    """Three steps (two micro-batches each, clipped) against PEFT on transformers' 4-bit model with torch's
    AdamW in float64 on the dequantized model, within twice the 4-bit model's own fp32 noise on them
    (`assert_adamw_steps_within_noise`)."""
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, CFG.vocab_size, (4, 16), generator=g) for _ in range(3)]
    tc = _settings("fp4", False, lr=1e-2, max_grad_norm=0.5, weight_decay=0.1, grad_accum=2)
    with StreamingTrainer.from_pretrained(checkpoint, tc) as trainer:
        start = _adapters(trainer)
        losses = [trainer.step(ids) for ids in batches]
        prefix = {f"block.{i}": f"model.layers.{i}." for i in range(CFG.num_hidden_layers)}
        ours = {k.replace("base_model.model.", ""): v.double()
                for k, v in trainer.adapters.hf_state_dict(prefix).items()}
    dequantized = _dequantized(_bnb_model(checkpoint, "fp4", False, "eager"))

    def exact_model() -> torch.nn.Module:
        base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
        base.load_state_dict(dequantized)
        return _peft(base, {k: v.double() for k, v in start.items()})

    references = [_peft(_bnb_model(checkpoint, "fp4", False, attn), start) for attn in ("eager", "sdpa")]
    assert_adamw_steps_within_noise(ours, losses, exact_model, references, batches, tc)


def assert_planned_to_the_byte(tmp_path: Path, tc: TrainerConfig, store: str, slab_bytes: Callable[[str], int]) -> None:
    """Device bytes at the peak, the host store and the bytes each step sends to the device: the planner's are a
    real step's of `tc` (on the `store` tier) to the byte, and the dry run's peak too; `slab_bytes(unit)`, a unit's
    packed slab."""
    ids = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(ids)
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
        host = trainer.store.spec.host_bytes()
    predicted = plan(CFG, device_spec("h100-sxm"), tc.plan_config(4, 16))
    dry = dry_run(CFG, tc, 4, 16)
    assert (predicted.peak_device_bytes, predicted.peak_breakdown) == real == (dry.peak, dict(dry.peak_breakdown))
    units = sum(slab_bytes(u) for u in CFG.unit_names())
    assert units < CFG.num_params() * 4 // 2  # the blocks' projections quantized
    # (A state file's trailer follows each unit's data on disk; the planner counts the data.)
    assert predicted.host_store_bytes == units == (host[0] if store == "ram" else host[1] - 4 * TRAILER_BYTES)
    assert predicted.link_bytes["h2d"] >= 2 * 2 * CFG.num_hidden_layers * slab_bytes("block.0")


@pytest.mark.parametrize("double_quant,store", [(False, "ram"), (True, "disk")])
def test_planner_ledger_and_dry_run_agree_to_the_byte(tmp_path: Path, double_quant: bool, store: str) -> None:
    tc = _settings("nf4", double_quant, grad_accum=2, activations="checkpoint", store=store)
    assert_planned_to_the_byte(tmp_path, tc, store, lambda unit: unit_bytes(CFG, unit, 4, double_quant))


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_4bit_bases_generation_charges_its_dequantized_weights_as_planned(tmp_path: Path,
                                                                             double_quant: bool) -> None:
    """GRPO's generation on a 4-bit base dequantizes each block's projections for its matmuls, as a step's forward
    does: the rollout plan's peak (units streamed, or resident) = the real generation's ledger = the dry run's, to
    the byte, and a block's moment holds the largest projection in fp32 beside the hidden state."""
    from memory_model.lora import dequantized_bytes
    from memory_model.rollout import generation_moments, kv_cache_bytes, rollout_plan
    from streamer.calibration.dryrun import dry_run_generation
    from streamer.generate import Sampling, generate

    tc = _settings("nf4", double_quant, method="grpo", num_generations=4, max_completion_length=6)
    pc = tc.plan_config(4, 16)
    planned = rollout_plan(CFG, device_spec("h100-sxm"), pc)  # a prompt of 10 tokens and 6 more
    prompt = torch.randint(1, CFG.vocab_size, (4, 10), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(CFG, tc, store_dir=tmp_path / "run") as trainer:
        for resident, way in ((False, planned.streamed), (True, planned.resident)):
            trainer.ledger.reset_peak()
            generate(trainer, prompt, Sampling(max_new_tokens=6, temperature=1.0), resident=resident)
            dry = dry_run_generation(CFG, tc, 4, 10, resident)
            assert (way.peak_bytes, way.peak_breakdown) == (trainer.ledger.peak, trainer.ledger.peak_breakdown) \
                == (dry.peak, dry.peak_breakdown)
    dequantized = dequantized_bytes(CFG, pc.lora, "block.0", 4)
    facet = CFG.lora()
    assert dequantized == 4 * max(i * o for i, o in map(facet.shape, facet.projections)) > 0
    moments = generation_moments(CFG, pc, 4, 10, kv_cache_bytes(CFG, 4, 16, 4))
    workspace = [m[-1] for m in moments]  # embed, the blocks, the head
    assert workspace[1:-1] == [workspace[0] + dequantized] * CFG.num_hidden_layers


def test_full_fine_tuning_on_a_4bit_base_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "llama-debug", "--load-in-4bit"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--lora-rank" in err and "--load-in-4bit" in err
    assert main(["train", "--model", "llama-debug", "--lora-rank", "4", "--load-in-4bit", "--data-parallel",
                 "sharded"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--data-parallel must be replicated with --load-in-4bit" in err, err


def test_streamer_plan_prints_the_4bit_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--batch", "1", "--seq", "2048", "--lora-rank", "8",
                 "--load-in-4bit", "--bnb-4bit-quant-type", "nf4"]) == 0
    out = capsys.readouterr().out
    assert "4-bit nf4 base" in out
    cfg = PRESETS["llama-3.1-8b"]
    block = unit_bytes(cfg, "block.0", 2, False)
    assert block < cfg.params().own("block.0") * 2 // 3  # 4-bit projections, not 16-bit ones
    row = next(line for line in out.splitlines() if line.startswith("│ block.0 "))
    assert format_size(block) in row


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_plans_its_4bit_base_to_the_byte_or_refuses_it(tmp_path: Path, model_type: str) -> None:
    """Planner = ledger = dry run for a 4-bit base with adapters on every projection of each registered family (a
    mixture's fused expert tensors too), and the host store's bytes."""
    cfg = FAMILIES[model_type].example()
    tc = TrainerConfig.of(dtype="bf16", store="ram", activations="checkpoint", lora_rank=4, load_in_4bit=True,
                          lora_targets=",".join(cfg.lora().projections), bnb_4bit_quant_type="nf4",
                          bnb_4bit_use_double_quant=True)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5)))
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
        host = trainer.store.spec.host_bytes()[0]
    predicted = plan(cfg, device_spec("h100-sxm"), tc.plan_config(2, 24))
    assert (predicted.peak_device_bytes, predicted.peak_breakdown) == real
    assert predicted.host_store_bytes == host == sum(unit_bytes(cfg, u, 2, True) for u in cfg.unit_names())
    assert host < cfg.num_params() * 2 // 2  # the blocks' projections (a mixture's experts too) 4-bit
    dry = dry_run(cfg, tc, 2, 24)
    assert {k: v for k, v in real[1].items() if k != "activations"} == \
        {k: v for k, v in dict(dry.peak_breakdown).items() if k != "activations"}


def _train(run: Path, steps: int) -> None:
    assert main(["train", "--model", "llama-debug", "--lora-rank", "4", "--load-in-4bit", "--bnb-4bit-quant-type",
                 "nf4", "--bnb-4bit-use-double-quant", "--run-dir", str(run), "--steps", str(steps), "--batch", "2",
                 "--seq", "32", "--lr", "1e-2", "--dtype", "fp32", "--eval-every", "0", "--sample-tokens", "4"]) == 0


def test_a_4bit_run_resumes_bit_identically_generates_and_exports_its_adapters(tmp_path: Path) -> None:
    _train(tmp_path / "straight", 3)
    _train(tmp_path / "resumed", 2)
    assert main(["train", "--resume", str(tmp_path / "resumed"), "--steps", "3"]) == 0
    import safetensors.torch
    states = [safetensors.torch.load_file(next((tmp_path / name / "store").glob("lora-*.safetensors")))
              for name in ("straight", "resumed")]
    assert states[0].keys() == states[1].keys() and any(key.startswith("params/") for key in states[0])
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key
    assert main(["generate", str(tmp_path / "resumed"), "--prompt", "The", "--max-new-tokens", "4"]) == 0
    assert main(["export", str(tmp_path / "resumed"), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    # The merged export is the model trained: the 4-bit base dequantized, the adapters added.
    assert main(["export", str(tmp_path / "resumed"), str(tmp_path / "merged")]) == 0
    merged = safetensors.torch.load_file(tmp_path / "merged" / "model.safetensors")
    with open_trainer(RunDir(tmp_path / "resumed")) as trainer:
        expected = trainer.state_dict()
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in merged)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_a_folder_quantized_by_another_method_is_one_line_naming_it(tmp_path: Path, checkpoint: Path, method: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    quantization = {"quant_method": method}
    folder = tmp_path / "quantized"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    (tmp_path / "train.txt").write_text("a few words to train on\n" * 20)
    assert main(["train", "--from-pretrained", str(folder), "--data", str(tmp_path / "train.txt"), "--lora-rank", "4",
                 "--load-in-4bit", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"quantized by {method!r}" in err, err
    assert not (tmp_path / "run").exists()


def test_a_folder_transformers_saved_4bit_imports_its_pieces_as_saved(tmp_path: Path, checkpoint: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' own 4-bit folder (quantization_config, W, W.absmax, W.nested_absmax, W.quant_map, ...,
    W.quant_state.bitsandbytes__nf4) trains as the 16-bit folder quantized on import: the same bytes in the store.
    Its settings are the folder's: others are one line naming the flags that match it."""
    saved = tmp_path / "llama-bnb-4bit"
    _bnb_model(checkpoint, "nf4", True, "eager").save_pretrained(saved)
    slabs = []
    for folder in (checkpoint, saved):
        with StreamingTrainer.from_pretrained(folder, _settings("nf4", True)) as trainer:
            slabs.append({u: trainer.store.slab(u, "compute").clone() for u in CFG.unit_names()})
    for unit in CFG.unit_names():
        assert torch.equal(slabs[0][unit], slabs[1][unit]), unit
    (tmp_path / "train.txt").write_text("a few words to train on\n" * 20)
    capsys.readouterr()
    assert main(["train", "--from-pretrained", str(saved), "--data", str(tmp_path / "train.txt"), "--lora-rank", "4",
                 "--load-in-4bit", "--seq", "16", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--bnb-4bit-quant-type nf4 --bnb-4bit-use-double-quant" in err, err


def test_the_peft_export_loads_on_transformers_4bit_model_with_our_loss(tmp_path: Path, checkpoint: Path) -> None:
    """The adapters as PEFT writes them, loaded by peft onto transformers' 4-bit model of the same folder: its
    loss is ours within the 4-bit model's own fp32 error (eager against sdpa) and fp32's rounding."""
    from streamer.cli.export import export_peft

    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with StreamingTrainer.from_pretrained(checkpoint, _settings("nf4", True)) as trainer:
        _adapters(trainer)
        ours = trainer.evaluate(ids)
        export_peft(trainer, tmp_path / "adapter", str(checkpoint))
    losses = []
    for attn in ("eager", "sdpa"):
        # (training mode, as _bnb_model: no dropout, and bitsandbytes keeps its weights as saved)
        model = peft.PeftModel.from_pretrained(_bnb_model(checkpoint, "nf4", True, attn), tmp_path / "adapter").train()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item())
    noise = abs(losses[0] - losses[1])
    assert abs(ours - losses[0]) <= 2 * noise + 4 * abs(ours) * torch.finfo(torch.float32).eps


def projection_errors(theirs: torch.nn.Module, ours: torch.nn.Module, named: dict[str, torch.Tensor],
                      x: torch.Tensor, exact_weight: torch.Tensor, bias: torch.Tensor) -> list[tuple[float, float]]:
    """bitsandbytes' projection `theirs` and ours (its tensors `named`) on `x`: for the output and the input's
    gradient, (theirs' error, ours') against the product with `exact_weight` in float64."""
    results = []
    for run in (lambda t: theirs(t), lambda t: torch.func.functional_call(ours, named, (t,))):
        t = x.clone().requires_grad_()
        out = run(t)
        out.backward(torch.ones_like(out))
        results.append((out.detach().double(), t.grad.double()))
    x64 = x.double().requires_grad_()
    exact = x64 @ exact_weight.double().T + bias.double()
    exact.backward(torch.ones_like(exact))
    return [((reference - truth).abs().max().item(), (mine - truth).abs().max().item())
            for mine, reference, truth in zip(results[1], results[0], (exact.detach(), x64.grad), strict=True)]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_4bit_projection_computes_as_bitsandbytes_linear4bit(compute: torch.dtype) -> None:
    """Our Linear4bit against bitsandbytes' (bnb_4bit_compute_dtype `compute`) on the same packed weight: output and
    input gradient within twice bitsandbytes' own error against the dequantized weight's product in float64."""
    from layers.quant4 import Linear4bit, Quant4, quantize

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    x = torch.randn(5, 128, generator=g, dtype=torch.float32)
    theirs = bnb.nn.Linear4bit(128, 96, compute_dtype=compute, quant_type="nf4", compress_statistics=True)
    theirs.load_state_dict({"weight": weight, "bias": bias})
    theirs = theirs.to("cpu")  # quantizes, as transformers' loading does
    theirs.train()
    ours = Linear4bit(128, 96, True, Quant4("nf4", True, torch.float32), compute)
    named = {**quantize(weight, ours.quant), "bias": bias}
    exact_weight = bnb.functional.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state)
    for noise, error in projection_errors(theirs, ours, named, x, exact_weight, bias):
        assert 0 < noise and error <= 2 * noise
        # In bf16 ours carries bf16's rounding as theirs does (in fp32 it would be some 1e-4 of it).
        assert compute == torch.float32 or error >= noise / 8


def test_a_mixture_folder_transformers_saved_4bit_trains_through_the_cli(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """transformers 5's 4-bit folder of a mixture (its attention's Linear weights 4-bit, its experts and router
    16-bit, one expert a tensor) trains with adapters on every projection, its experts quantized on import as the
    16-bit folder's are. Bad input is one line: full fine-tuning names --lora-rank; a folder whose experts were
    saved 4-bit one at a time (transformers before 5) asks for the 16-bit checkpoint; another quant_method is
    named."""
    import dataclasses

    import safetensors.torch

    from tests.test_data_cli import write_tokenizer

    cfg = dataclasses.replace(FAMILIES["mixtral"].example(), vocab_size=448)
    folders = {name: tmp_path / name for name in ("16bit", "4bit", "per-expert", "gptq")}
    hf_model(cfg).save_pretrained(folders["16bit"])
    _bnb_model(folders["16bit"], "nf4", True, "eager").save_pretrained(folders["4bit"])
    shutil.copytree(folders["4bit"], folders["per-expert"])
    tensors = safetensors.torch.load_file(folders["per-expert"] / "model.safetensors")
    for key in [k for k in tensors if ".experts." in k]:  # each expert's Linear4bit, as transformers 4 saved it
        packed, state = bnb.functional.quantize_4bit(tensors.pop(key), blocksize=64, compress_statistics=True,
                                                     quant_type="nf4")
        tensors.update({key: packed, **{f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()}})
    safetensors.torch.save_file(tensors, folders["per-expert"] / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(folders["16bit"], folders["gptq"])
    config = json.loads((folders["gptq"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (folders["gptq"] / "config.json").write_text(json.dumps(config))
    for folder in folders.values():
        write_tokenizer(folder, "qwen")
    (tmp_path / "train.txt").write_text("a few words to train on\n" * 20)
    qlora = ["--lora-rank", "4", "--lora-targets", ",".join(cfg.lora().projections), "--load-in-4bit",
             "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant"]

    def train(folder: str, run: Path, *flags: str) -> int:
        capsys.readouterr()
        return main(["train", "--from-pretrained", str(folders[folder]), "--data", str(tmp_path / "train.txt"),
                     "--seq", "16", "--batch", "2", "--steps", "1", "--dtype", "fp32", "--eval-every", "0",
                     "--sample-tokens", "0", "--run-dir", str(run), *flags])

    tc = TrainerConfig.of(dtype="fp32", store="ram", lora_rank=RANK, lora_targets=",".join(cfg.lora().projections),
                          load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    slabs = []
    for folder in ("16bit", "4bit"):
        with StreamingTrainer.from_pretrained(folders[folder], tc) as trainer:
            slabs.append({u: trainer.store.slab(u, "compute").clone() for u in cfg.unit_names()})
    assert all(torch.equal(slabs[0][u], slabs[1][u]) for u in cfg.unit_names())
    assert train("4bit", tmp_path / "run", *qlora) == 0
    assert (tmp_path / "run" / "config.toml").is_file()
    for folder, flags, expected in (("4bit", (), "--lora-rank R --load-in-4bit --bnb-4bit-quant-type nf4"),
                                    ("per-expert", qlora, "pass the 16-bit checkpoint with --load-in-4bit"),
                                    ("gptq", qlora, "quantized by 'gptq'")):
        assert train(folder, tmp_path / "refused", *flags) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err
        assert not (tmp_path / "refused").exists()
