"""gpt-oss, not yet registered: every test tests/test_families.py and tests/test_hub_configs.py give a registered
family, run with it in `FAMILIES` for the test (`registered`), but the streamed-training one, which it misses:
its weights after 3 steps are 1.77e-5 from float64 transformers' on this CPU (native and AVX2 alike) against
transformers' own fp32 8.55e-6 (3.2e-6 under AVX2), all of it one v_proj weight whose first gradient (3.3e-8) is
below its tensor's fp32 noise (4e-8) and near Adam's eps; transformers has one CPU kernel for gpt-oss (no SDPA
with sinks), so its noise is one sample. And what is its own: the published shapes' parameter counts, YaRN's
tables against transformers' to the bit, the published checkpoints' MXFP4 experts dequantized as transformers
dequantizes them, and what its config refuses."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

import tests.test_families as families
import tests.test_hub_configs as hub_configs
from layers import FAMILIES, PRESETS, ConfigError, GptOssConfig, ModelConfig, resident_model
from layers.rotary import positions_sincos, rows_sincos
from streamer.io.hf import FP4_VALUES, HFCheckpoint
from tests.test_families import hf_model
from tests.test_moe import transformers_count

HUB = Path(__file__).parent / "hub_configs"
PUBLISHED = HUB / "unregistered" / "gpt-oss-20b.json"


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt_oss in the registry for the test: what config.json's model_type picks from."""
    monkeypatch.setitem(FAMILIES, GptOssConfig.model_type, GptOssConfig)


def test_the_family_is_its_transformers_class() -> None:
    families.test_the_family_is_its_transformers_class("gpt_oss")


def test_logits_and_gradients_equal_transformers_within_its_fp32_noise() -> None:
    families.test_logits_and_gradients_equal_transformers_within_its_fp32_noise("gpt_oss")


def test_cli_trains_a_transformers_folder_exports_and_generates(capsys, tmp_path: Path, tiny_setup: Path) -> None:
    families.test_cli_trains_a_transformers_folder_exports_and_generates(capsys, tmp_path, tiny_setup, "gpt_oss")


@pytest.mark.parametrize("dtype,activations,store,lora", [("fp32", "resident", "ram", 0),
                                                          ("bf16", "checkpoint", "disk", 0),
                                                          ("bf16", "resident", "ram", 4)])
def test_planner_dry_run_and_real_run_agree_to_the_byte(tmp_path: Path, dtype: str, activations: str, store: str,
                                                        lora: int) -> None:
    families.test_planner_dry_run_and_real_run_agree_to_the_byte(tmp_path, "gpt_oss", dtype, activations, store,
                                                                 lora)


def test_lora_on_every_projection_exports_what_peft_loads(capsys, tmp_path: Path, tiny_setup: Path) -> None:
    families.test_lora_on_every_projection_exports_what_peft_loads(capsys, tmp_path, tiny_setup, "gpt_oss")


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path: Path) -> None:
    families.test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path, "gpt_oss")


def test_the_published_config_is_transformers_model(tmp_path: Path) -> None:
    hub_configs.test_published_config_is_transformers_model(tmp_path, "unregistered/gpt-oss-20b")


def test_presets_have_transformers_parameter_counts() -> None:
    assert PRESETS["gpt-oss-20b"].num_params() == transformers_count(PRESETS["gpt-oss-20b"]) == 20_914_757_184
    assert PRESETS["gpt-oss-120b"].num_params() == transformers_count(PRESETS["gpt-oss-120b"]) == 116_829_156_672
    assert PRESETS["gpt-oss-20b"] == ModelConfig.from_hf(PUBLISHED)


@pytest.mark.parametrize("published", [True, False], ids=["published", "example"])
def test_yarn_tables_are_transformers_to_the_bit(published: bool) -> None:
    """sin and cos of the published YaRN (theta 150000, 32 x 4096 positions, not truncated; the attention factor
    0.1 ln 32 + 1) and of the example's (truncated), over positions on both sides of the original context:
    transformers' GptOssRotaryEmbedding's, bit for bit, for a sequence and for packed rows."""
    cfg = GptOssConfig.example()
    if published:
        cfg = dataclasses.replace(PRESETS["gpt-oss-20b"], vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                  num_experts_per_tok=1, intermediate_size=8, attention_layers=None,
                                  pad_token_id=None, max_position_embeddings=8192)
    theirs = GptOssRotaryEmbedding(transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    length = cfg.max_position_embeddings
    cos_hf, sin_hf = (t[0] for t in theirs(torch.zeros(1, length, 1), torch.arange(length)[None]))
    sin, cos = positions_sincos(cfg.max_position_embeddings, cfg.rotary_dim, 0, length, torch.float32,
                                torch.device("cpu"), cfg.rope_parameters)
    assert torch.equal(sin, sin_hf) and torch.equal(cos, cos_hf)
    assert cos.abs().max().item() > 1.1  # the attention factor is there
    rows = torch.arange(length).flip(0)[None]
    sin_rows, cos_rows = rows_sincos(cfg.max_position_embeddings, cfg.rotary_dim, rows, torch.float32,
                                     cfg.rope_parameters)
    assert torch.equal(sin_rows[0], sin.flip(0)) and torch.equal(cos_rows[0], cos.flip(0))


def packed(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales for a tensor shaped like `values` (E, in, out), and the values they hold,
    from their definition: each of the out rows' `in` values in groups of 32, code i of a group in byte i // 2
    (the low 4 bits first), times 2^(scale - 127)."""
    experts, width, rows = values.shape
    g = torch.Generator().manual_seed(width + rows)
    codes = torch.randint(0, 16, (experts, rows, width // 32, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 135, (experts, rows, width // 32), generator=g, dtype=torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    exact = torch.tensor(FP4_VALUES, dtype=torch.float64)[codes.long()] * 2.0 ** (scales.double()[..., None] - 127)
    return blocks, scales, exact.reshape(experts, rows, width).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path, dtype: torch.dtype) -> None:
    """A folder as gpt-oss is published: its experts as MXFP4 blocks and scales (`*_blocks`, `*_scales`), the
    rest as tensors. The checkpoint lists and validates them as the model's tensors and reads them in the dtype
    asked equal to transformers' `convert_moe_packed_tensors`, and to the values the codes and scales define."""
    cfg = dataclasses.replace(GptOssConfig.example(), hidden_size=64, intermediate_size=32)
    state = hf_model(cfg).state_dict()
    saved, expected = {}, {}
    for key, tensor in state.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = packed(tensor)
            saved[f"{key}_blocks"], saved[f"{key}_scales"], expected[key] = blocks, scales, values
        else:
            saved[key] = tensor.to(torch.bfloat16)
    save_file(saved, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg.adapter().to_hf(),
                                                      "quantization_config": {"quant_method": "mxfp4"}}))
    with HFCheckpoint.open(tmp_path) as checkpoint:
        checkpoint.validate()
        assert set(checkpoint.keys()) == set(state)
        for key, values in expected.items():
            read = checkpoint.read(key, dtype)
            theirs = convert_moe_packed_tensors(saved[f"{key}_blocks"], saved[f"{key}_scales"], dtype=dtype)
            assert read.dtype == dtype and torch.equal(read, theirs)
            assert torch.equal(read.double(), values)
        model = resident_model(cfg, init=False)
        model.load_hf_state_dict({key: checkpoint.read(key) for key in checkpoint.keys()})


@pytest.mark.parametrize("edit,message", [
    ({"output_router_logits": True}, "output_router_logits=true is not supported for gpt_oss"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' is not supported for gpt_oss"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must name 24 layers"),
])
def test_what_gpt_oss_refuses_is_named_in_one_line(edit: dict, message: str) -> None:
    raw = {**json.loads(PUBLISHED.read_text()), **edit}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


def test_a_config_without_rope_is_transformers_default_yarn() -> None:
    """transformers' GptOssConfig gives a file without rope_parameters or rope_scaling YaRN over 32 x 4096 (theta
    150000, not truncated): so does ours, and transformers' own class reads ours back the same."""
    raw = {k: v for k, v in json.loads(PUBLISHED.read_text()).items()
           if k not in ("rope_scaling", "rope_theta")}
    ours = ModelConfig.from_hf(raw)
    assert ours == PRESETS["gpt-oss-20b"]
    assert transformers.AutoConfig.for_model(**raw).rope_parameters == ours.rope
