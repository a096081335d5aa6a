"""config.json files as users bring them, read as transformers reads them: the published files of every supported
family (tests/hub_configs/, as the hub ships them), the folder transformers writes from a GGUF file, and files
missing a field. Each is held against transformers' own model of the same file, built on the `meta` device."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from layers import FAMILIES, ConfigError, ModelConfig, resident_model
from memory_model import PlanConfig, device_spec, plan
from streamer.io.hf import HFCheckpoint, expected_tensors
from streamer.run import resolve
from tests.test_cli import fails, run_cli

HUB = Path(__file__).parent / "hub_configs"
PUBLISHED = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b-v0.1", "mistral-7b-v0.2",
             "mistral-7b-v0.3", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b",
             "qwen2.5-32b", "qwen2.5-72b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b",
             "qwen3-32b", "olmo-2-1124-7b", "gpt-j-6b", "phi-3-mini-4k-instruct", "phi-3.5-mini-instruct", "phi-4",
             "gemma-3-1b-it", "qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b-0924")


def published(name: str) -> dict[str, Any]:
    return json.loads((HUB / f"{name}.json").read_text())


def transformers_model(raw: dict[str, Any]) -> transformers.PreTrainedModel:
    """transformers' model of a config.json's keys, on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))


def transformers_params(raw: dict[str, Any]) -> int:
    return sum(p.numel() for p in transformers_model(raw).parameters())  # a tied weight is one parameter


def test_every_supported_family_has_its_published_configs():
    assert sorted(p.stem for p in HUB.glob("*.json")) == sorted(PUBLISHED)
    assert {published(name)["model_type"] for name in PUBLISHED} == set(FAMILIES)  # every family has its own


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_is_transformers_model(tmp_path, name):
    """The file, and a --from-pretrained folder holding it, give the model transformers builds from it: the same
    tensors by name and shape, and the planner counts transformers' parameters."""
    path = HUB / f"{name}.json"
    cfg = ModelConfig.from_hf(path)
    (tmp_path / "config.json").write_bytes(path.read_bytes())
    assert resolve({"from_pretrained": str(tmp_path), "data": str(tmp_path / "train.txt")}).model_config() == cfg
    theirs = transformers_model(published(name))
    state = {k: tuple(v.shape) for k, v in theirs.state_dict().items()
             if k not in cfg.adapter().tied_keys() and not k.endswith(cfg.ignored_checkpoint_suffixes)}
    assert {k: tuple(v.shape) for k, v in expected_tensors(cfg).items()} == state
    count = sum(p.numel() for p in theirs.parameters())
    seq = min(2048, cfg.attention().context()[0])
    assert plan(cfg, device_spec("h100-sxm"), PlanConfig.of(batch=1, seq=seq), limits=False).params == count


@pytest.mark.parametrize("name", ["qwen2.5-7b", "mistral-7b-v0.1", "gemma-3-1b-it", "gpt-j-6b"])
def test_streamer_plan_reads_a_published_config(name):
    """`streamer plan --model config.json` as a user types it: the plan counts transformers' parameters."""
    done = subprocess.run([sys.executable, "-m", "streamer", "plan", "--model", str(HUB / f"{name}.json"),
                           "--target", "h100-sxm", "--batch", "1", "--seq", "2048", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["params"] == transformers_params(published(name))


# Fields a published file may carry that transformers' class for its model_type never reads: ours is the
# unedited file's model, and so is transformers'.
UNREAD = [
    ("qwen2.5-7b", {"use_mrope": True}),  # Qwen2 reads no use_mrope; M-RoPE over text positions is RoPE
    ("qwen2.5-7b", {"attention_bias": True}),  # Qwen2's q/k/v always have biases, its o_proj never
    ("mistral-7b-v0.3", {"mlp_bias": True, "attention_bias": True}),
    ("llama-3.1-8b", {"sliding_window": 4096, "use_sliding_window": True, "pretraining_tp": 2}),
    ("qwen3-8b", {"mlp_bias": True, "use_mrope": False}),
    ("olmo-2-1124-7b", {"mlp_bias": True, "sliding_window": 4096}),  # Olmo2's MLP has no biases, no window
    ("llama-3.2-1b", {"_model_name_or_path": "tiny", "unk_token_id": 0, "pad_token_id": None,
                      "quantization_config": {"quant_method": "gguf", "dequantize": False}}),
    ("gpt-j-6b", {"scale_attn_weights": False, "rotary": True, "n_ctx": 2048, "summary_type": "mean"}),
    ("qwen3-30b-a3b", {"router_aux_loss_coef": 0.5, "mlp_bias": True}),  # the loss only with output_router_logits
]


@pytest.mark.parametrize("name,edit", UNREAD, ids=[f"{n}-{'-'.join(e)}" for n, e in UNREAD])
def test_fields_transformers_does_not_read_are_kept_out(name, edit):
    raw = {**published(name), **edit}
    assert ModelConfig.from_hf(raw) == ModelConfig.from_hf(HUB / f"{name}.json")
    assert ModelConfig.from_hf(raw).num_params() == transformers_params(raw)


# Values that change the math and are not implemented: one line naming the field and the value.
REFUSED = [
    ("qwen2.5-7b", {"rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}},
     "rope_type 'yarn' is not supported"),  # Qwen2.5's README's long-context edit
    ("llama-3.1-8b", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("qwen3-8b", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ("llama-3.2-1b", {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported"),
    ("gpt-j-6b", {"resid_pdrop": 0.1}, "resid_pdrop=0.1 is not supported"),
    ("phi-4", {"embd_pdrop": 0.1}, "embd_pdrop=0.1 is not supported"),
    ("phi-3.5-mini-instruct", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic' is not supported for phi3"),
    ("phi-3.5-mini-instruct", {"partial_rotary_factor": 0.75},
     "rope_parameters['short_factor'] must be 36 positive numbers for longrope"),
    ("gemma-3-1b-it", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ("gemma-3-1b-it", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gpt-j-6b", {"activation_function": "relu"}, "activation_function 'relu' is not supported"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [0, 1]}, "mlp_only_layers=[0, 1] make some layers dense"),
    ("qwen3-30b-a3b", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 and mlp_only_layers=[] make some layers"),
    ("mixtral-8x7b", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
]


@pytest.mark.parametrize("name,edit,message", REFUSED, ids=[f"{n}-{'-'.join(e)}" for n, e, _ in REFUSED])
def test_values_that_change_the_math_are_refused_in_one_line(capsys, tmp_path, name, edit, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**published(name), **edit}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf(path)
    assert message in fails(capsys, "plan", "--model", path)


@pytest.mark.parametrize("edit,window", [
    ({}, None),  # published: use_sliding_window false
    ({"use_sliding_window": True, "sliding_window": 4096}, None),  # max_window_layers 28 of 28: no layer slides
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}, 4096),
    ({"use_sliding_window": True, "sliding_window": 4096, "layer_types": ["sliding_attention"] * 28}, 4096),
    ({"use_sliding_window": False, "sliding_window": 4096, "layer_types": ["sliding_attention"] * 28}, None),
])
def test_a_qwen_window_is_on_where_transformers_puts_it(tmp_path, edit, window):
    """Qwen2's window slides only with use_sliding_window and only on the layers from max_window_layers on (or
    those layer_types names). A window caps the sequence at its length, within which it changes nothing; the
    export puts it where it was."""
    def sliding(config: transformers.PretrainedConfig) -> tuple[Any, list[str]]:
        """The window transformers applies and the layers it slides on."""
        layers = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
        return (config.sliding_window, layers) if config.sliding_window is not None and layers else (None, [])

    raw = {**published("qwen2.5-7b"), **edit}
    theirs = sliding(transformers.AutoConfig.for_model(**raw))
    assert theirs[0] == window
    cfg = ModelConfig.from_hf(raw)
    assert cfg.attention().context()[0] == (window or raw["max_position_embeddings"])
    assert sliding(transformers.AutoConfig.for_model(**cfg.adapter().to_hf())) == theirs


@pytest.mark.parametrize("edit,which", [
    ({"max_window_layers": 14}, "max_window_layers=14 slides 14 of 28 layers"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 14}, "layer_types slides 14 of 28 layers"),
])
def test_a_qwen_window_on_some_layers_only_is_refused(edit, which):
    raw = {**published("qwen2.5-7b"), "use_sliding_window": True, "sliding_window": 4096, **edit}
    with pytest.raises(ConfigError, match=re.escape(f"use_sliding_window=true with {which}")):
        ModelConfig.from_hf(raw)


def test_transformers_defaults_fill_what_a_config_leaves_out():
    """Only the required sizes given: each family takes transformers' defaults (Qwen3's head_dim 128, Qwen2's
    32 key/value heads, Mistral's 4096 window, Gemma 3's head_dim 256)."""
    sizes = {"vocab_size": 96, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 32,
             "intermediate_size": 48}
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
        raw = {"model_type": model_type, **sizes}
        theirs = transformers.AutoConfig.for_model(**raw)
        cfg = ModelConfig.from_hf(raw)
        assert cfg.num_params() == transformers_params(raw), model_type
        assert (cfg.head_dim, cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.sliding_window) == (
            getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads,
            theirs.num_key_value_heads, theirs.max_position_embeddings,
            getattr(theirs, "sliding_window", None)), model_type
    gptj = {"model_type": "gptj", "vocab_size": 96, "n_embd": 256, "n_layer": 2, "n_head": 4}  # rotary_dim 64
    assert ModelConfig.from_hf(gptj).num_params() == transformers_params(gptj)


@pytest.mark.parametrize("name,field,shown", [
    ("llama-3.1-8b", "num_hidden_layers", "num_hidden_layers"),
    ("qwen2.5-7b", "intermediate_size", "intermediate_size"),
    ("qwen3-8b", "vocab_size", "vocab_size"),
    ("gpt-j-6b", "n_embd", "n_embd (hidden_size)"),
])
def test_a_missing_field_is_named(capsys, tmp_path, name, field, shown):
    raw = published(name)
    del raw[field]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    message = f"the {raw['model_type']} config has no {shown}; add it as transformers writes it"
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf(path)
    assert message in fails(capsys, "plan", "--model", path)


def test_a_misspelt_field_is_a_missing_one():
    raw = published("gpt-j-6b")
    raw["n_embed"] = raw.pop("n_embd")
    with pytest.raises(ConfigError, match=re.escape("the gptj config has no n_embd (hidden_size)")):
        ModelConfig.from_hf(raw)


def test_from_pretrained_without_num_hidden_layers_names_the_field(capsys, tmp_path, tiny_setup):
    """A folder whose config.json lost num_hidden_layers: one line naming it, not the state dict's keys."""
    raw = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' progress bars
    line = fails(capsys, "train", "--from-pretrained", tmp_path, "--data", tiny_setup / "train.txt",
                 "--run-dir", tmp_path / "run", "--steps", 1)
    assert "the llama config has no num_hidden_layers" in line
    assert "layers.0" not in line


# --- a folder transformers wrote from a GGUF file ---------------------------------------------------------

def write_tiny_gguf(path: Path) -> None:
    """A llama-architecture GGUF file of tiny sizes, its weights float32, with a SentencePiece-style vocabulary
    (byte fallback) as llama.cpp's converter writes one."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    d, f, layers, heads, kv, hd = 32, 48, 2, 4, 2, 8
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), "▁", "a", "b", "▁a", "ab"]
    kinds = [2, 3, 3, *[6] * 256, *[1] * 5]  # unknown, control, byte, normal
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), d), "output_norm.weight": (d,), "output.weight": (len(tokens), d)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
                       f"blk.{i}.attn_q.weight": (heads * hd, d), f"blk.{i}.attn_k.weight": (kv * hd, d),
                       f"blk.{i}.attn_v.weight": (kv * hd, d), f"blk.{i}.attn_output.weight": (d, heads * hd),
                       f"blk.{i}.ffn_gate.weight": (f, d), f"blk.{i}.ffn_up.weight": (f, d),
                       f"blk.{i}.ffn_down.weight": (d, f)})
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_folder_transformers_wrote_from_gguf_trains(capsys, tmp_path, tiny_setup):
    """transformers reads the GGUF file (`from_pretrained(dir, gguf_file=...)`) and saves the folder users then
    bring: its config.json carries GGUF's `_model_name_or_path` and `unk_token_id` and a `quantization_config`
    over float32 weights. --from-pretrained reads it, our logits are transformers' within its fp32 noise, and
    `streamer train` runs on it."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    # transformers 5 will not save a model it loaded from GGUF (its GGUF quantizer says it cannot serialize),
    # though the weights it holds are dequantized float32: without the quantizer it writes the folder.
    theirs.hf_quantizer = None
    folder = tmp_path / "hf"
    theirs.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    assert {"_model_name_or_path", "unk_token_id", "quantization_config"} <= set(written)

    with HFCheckpoint.open(folder) as checkpoint:
        checkpoint.validate()
        cfg = checkpoint.config
        state = dict(checkpoint.iter_tensors())
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    exact = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                                              dtype=torch.float64).eval()
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(state)
    with torch.no_grad():
        reference = exact(ids).logits
        noise = (theirs(ids).logits.double() - reference).abs().max().item()
        error = (ours(ids).double() - reference).abs().max().item()
    assert error <= 2 * noise + 1e-6, (error, noise)

    rc, _, err = run_cli(capsys, "train", "--from-pretrained", folder, "--data", tiny_setup / "train.txt",
                         "--run-dir", tmp_path / "run", "--steps", 1, "--batch", 1, "--seq", 16, "--dtype", "fp32",
                         "--sample-tokens", 0, "--eval-fraction", 0)
    assert rc == 0, err
