"""A GGUF file as a frozen base (--from-pretrained FILE.gguf): its block projections kept as the file's blocks and
dequantized as the gguf package does; the weights, the logits and the tokenizer against transformers' `gguf_file=`
loading of the same file; LoRA steps on it; planner = ledger = dry run; the refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from layers import PRESETS
from layers.packed_gguf import TYPE_IDS, TYPE_SIZES, row_bytes
from memory_model import device_spec, plan
from memory_model.lora import LoraConfig, dequantized_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run
from streamer.store.slabfile import TRAILER_BYTES
from streamer.io.gguf import GGUFCheckpoint

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")

T = gguf.GGMLQuantizationType
# One type per projection of each block, so every type the base keeps is held against transformers.
TYPES = {0: ("Q4_0", "Q4_K", "Q8_0", "Q5_K", "Q6_K", "Q4_1", "F16"),
         1: ("Q6_K", "BF16", "Q4_K", "Q8_0", "Q5_K", "F32", "Q4_0")}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEADS, KV_HEADS = 4, 2


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of q and k rows (interleaved RoPE), which transformers undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_blocks(rows: int, columns: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of a K-type gguf only dequantizes: random codes under small finite fp16 scales."""
    elements, nbytes = TYPE_SIZES[type_name]
    blocks = rng.integers(0, 256, size=(rows * columns // elements, nbytes), dtype=np.uint8)
    scale = np.full(len(blocks), 0.002, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    if type_name == "Q6_K":  # ql, qh, scales, then d
        blocks[:, -2:] = scale
    else:  # d, dmin, then scales and codes
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tied: bool = False, types: dict[int, tuple[str, ...]] = TYPES,
               config: transformers.PretrainedConfig | None = None) -> Path:
    """A tiny model as llama.cpp writes it: its metadata, a byte-level BPE tokenizer, and each block projection
    of the type `types` names, in the order its block holds them (quantized by gguf where it can, else valid blocks
    of random codes). `config`: transformers' config of a model of an architecture the base reads (a Llama's by
    default); its GGUF tensors are what llama.cpp's converter writes (Llama's q and k rows permuted, Gemma's norms
    plus one)."""
    torch.manual_seed(0)
    config = config or transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
        tie_word_embeddings=tied)
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    arch = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch in ("gemma3", "qwen3moe"):
        writer.add_key_length(config.head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_symbols = bytes_to_unicode()
    # (transformers' byte-level tokenizer adds <|endoftext|> where the list lacks it)
    tokens = [byte_symbols[i] for i in range(256)] + ["he", "ll", "hell", "hello"] + [f"<t{i}>" for i in range(39)] \
        + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(["h e", "l l", "he ll", "hell o"])
    writer.add_bos_token_id(260)
    writer.add_eos_token_id(261)
    if getattr(config, "pad_token_id", None) is not None:
        writer.add_pad_token_id(config.pad_token_id)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    rng = np.random.default_rng(0)
    seen: dict[int, int] = {}  # each layer's projections so far
    for key, value in state.items():
        if config.tie_word_embeddings and key == "lm_head.weight":
            continue
        module, suffix = key.rsplit(".", 1)
        array = value.numpy()
        if array.ndim == 3:  # a mixture's fused experts: llama.cpp's ffn_{gate,up,down}_exps, each (E, out, in)
            layer = int(key.split(".")[2])
            type_name = types[layer][seen.setdefault(layer, 0) % len(types[layer])]
            seen[layer] += 1
            parts = ("gate_proj", "up_proj") if suffix == "gate_up_proj" else (suffix,)
            for part, piece in zip(parts, np.split(array, len(parts), axis=1), strict=True):
                experts, rows, columns = piece.shape
                if type_name in ("Q4_K", "Q5_K", "Q6_K"):
                    blocks = _k_blocks(experts * rows, columns, type_name, rng).reshape(experts, rows, -1)
                else:
                    blocks = gguf.quants.quantize(np.ascontiguousarray(piece, dtype=np.float32), T[type_name])
                writer.add_tensor(f"{names.get_name(f'{module}.{part}')}.weight", blocks, raw_dtype=T[type_name])
            continue
        name = f"{names.get_name(module)}.{suffix}"
        if ".mlp.gate." in key:  # a mixture's router, which llama.cpp keeps in float32
            writer.add_tensor(name, array.astype(np.float32))
            continue
        if arch == "llama" and "q_proj" in key:
            array = _permute(array, config.num_attention_heads)
        if arch == "llama" and "k_proj" in key:
            array = _permute(array, config.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1
        if not key.startswith("model.layers.") or array.ndim != 2:
            writer.add_tensor(name, array.astype(np.float32))
            continue
        layer = int(key.split(".")[2])
        type_name = types[layer][seen.setdefault(layer, 0) % len(types[layer])]
        seen[layer] += 1
        if type_name in ("Q4_K", "Q5_K", "Q6_K"):
            writer.add_tensor(name, _k_blocks(*array.shape, type_name, rng), raw_dtype=T[type_name])
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), T[type_name]),
                              raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf")


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                             dtype=torch.float32, attn_implementation="eager")


def _settings(**more: object) -> TrainerConfig:
    return TrainerConfig.of(**{"dtype": "fp32", "store": "ram", "lora_rank": 4, "lora_alpha": 8.0,
                               "lora_targets": ",".join(PROJECTIONS), **more})


def test_type_table_is_gguf_s() -> None:
    for name, size in TYPE_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[T[name]] == size
        assert int(T[name]) == TYPE_IDS[name]


@pytest.mark.parametrize("type_name", sorted(TYPE_SIZES))
def test_torch_dequantizes_every_kept_type_as_gguf_does(type_name: str) -> None:
    """The torch ops that dequantize a weight where it lies (on a GPU: unverified there; here on CPU tensors) give
    gguf.quants.dequantize's float32 values exactly: its arithmetic, op for op."""
    from layers.quant_gguf import DEQUANTIZED_BY_TORCH, dequantize_blocks

    assert DEQUANTIZED_BY_TORCH == set(TYPE_SIZES)
    rng = np.random.default_rng(3)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        blocks = _k_blocks(8, 512, type_name, rng)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((8, 512)).astype(np.float32), T[type_name])
    expected = gguf.quants.dequantize(blocks, T[type_name]).reshape(-1)
    ours = dequantize_blocks(torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)), type_name)
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_weights_equal_transformers(gguf_file: Path, reference: torch.nn.Module) -> None:
    """Every tensor, the kept blocks dequantized (Llama's q and k rows back in order), equals transformers'."""
    trainer = StreamingTrainer.from_pretrained(gguf_file, _settings())
    ours = trainer.state_dict()
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)  # both fp32 of gguf's float32
    kinds = {trainer.tc.lora.gguf.type_of(k) for k, _ in trainer.tc.lora.gguf.types}
    assert kinds == {t for row in TYPES.values() for t in row}
    trainer.close()


def test_logits_and_lora_steps(gguf_file: Path, reference: torch.nn.Module) -> None:
    """The loss equals transformers' on the file's model within twice its own fp32 noise (eager vs sdpa), and a
    few streamed LoRA steps lower it."""
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = reference(ids, labels=ids).loss.double()
        sdpa = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                                 dtype=torch.float32, attn_implementation="sdpa")
        noise = (sdpa(ids, labels=ids).loss.double() - loss).abs().item()
    trainer = StreamingTrainer.from_pretrained(gguf_file, _settings(lr=1e-2))
    ours = trainer.evaluate(ids)
    assert abs(ours - loss.item()) <= 2 * max(noise, 1e-6), (ours, loss.item(), noise)
    losses = [trainer.step(ids) for _ in range(3)]
    assert losses[-1] < losses[0]
    trainer.close()


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_planner_ledger_and_dry_run_agree_to_the_byte(gguf_file: Path, tmp_path: Path, store: str) -> None:
    """Device bytes at the peak, the host store and the bytes a step sends to the device, with the file's blocks
    priced: the planner's are the real run's to the byte, and the dry run's peak too."""
    checkpoint = GGUFCheckpoint.open(gguf_file)
    settings = {"grad_accum": 2, "activations": "checkpoint", "store": store}
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer.from_pretrained(gguf_file, _settings(**settings), tmp_path / "run") as trainer:
        trainer.step(ids)
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
        host = trainer.store.spec.host_bytes()
        tc = trainer.tc
    cfg, base = checkpoint.config, checkpoint.base()
    assert tc.lora.gguf == base
    predicted = plan(cfg, device_spec("h100-sxm"), tc.plan_config(4, 16))
    dry = dry_run(cfg, tc, 4, 16)
    assert (predicted.peak_device_bytes, predicted.peak_breakdown) == real == (dry.peak, dict(dry.peak_breakdown))
    units = sum(base.unit_bytes(cfg, u, 4) for u in cfg.unit_names())
    # Each block projection: its blocks as the file holds them (and its type's byte), each on 16 bytes; the rest
    # of the model in the compute dtype.
    held = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(gguf_file).tensors if t.name.startswith("blk.")
            and t.name.endswith(".weight") and len(t.shape) == 2}
    assert len(held) == len(base.types)
    rest = cfg.num_params() - sum(n // TYPE_SIZES[t][1] * TYPE_SIZES[t][0] for t, n in
                                  zip((t for _, t in base.types), held.values(), strict=True))
    assert units - sum(-(-n // 16) * 16 + 16 for n in held.values()) - rest * 4 in range(0, 16 * len(cfg.unit_names()))
    # (A state file's trailer follows each unit's data on disk; the planner counts the data.)
    assert predicted.host_store_bytes == units == (host[0] if store == "ram" else host[1] - 4 * TRAILER_BYTES)
    loads = 2 * 2 * cfg.num_hidden_layers * base.unit_bytes(cfg, "block.0", 4)
    assert predicted.link_bytes["h2d"] >= loads


def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "streamer", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def test_the_documented_command_trains_lora_on_a_gguf_file(gguf_file: Path, tmp_path: Path) -> None:
    """docs/CLI.md's command, through the documented override, trains; the run exports the model it trained,
    which transformers loads."""
    from tests.test_documented_commands import file_commands, override

    command = next(c for where, c in file_commands() if where == "CLI.md" and "MODEL.gguf" in c)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"hello {i} world", "completion": " hell"}) + "\n"
                            for i in range(40)))
    (tmp_path / "run").mkdir()
    argv = override(command, {"run": tmp_path / "run", "data": data, "toml": data, "gguf": gguf_file, "pairs": data,
                              "hf": tmp_path, "bnb4": tmp_path}, tmp_path / "work")
    (tmp_path / "work").mkdir(exist_ok=True)  # (the override copies the stand-in run into it)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path / "work", timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the planner predicts" in done.stdout
    run = tmp_path / "work" / "runs" / "gguf-lora"
    done = _cli("export", run, tmp_path / "merged", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.config.num_hidden_layers == 2


def test_full_fine_tuning_on_a_gguf_base_is_one_line(gguf_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("hello world\n" * 20)
    done = _cli("train", "--from-pretrained", gguf_file, "--data", data, "--run-dir", tmp_path / "run", cwd=tmp_path)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "--lora-rank" in err[0], done.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_type_without_a_dequantizer_is_one_line(tmp_path: Path) -> None:
    types = {i: ("Q5_0", *row[1:]) for i, row in TYPES.items()}  # Q5_0: gguf quantizes it, the base does not read it
    path = write_gguf(tmp_path / "q5.gguf", types=types)
    data = tmp_path / "data.txt"
    data.write_text("hello world\n" * 20)
    done = _cli("train", "--from-pretrained", path, "--data", data, "--lora-rank", "4", "--run-dir",
                tmp_path / "run", cwd=tmp_path)
    err = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(err) == 1 and "Q5_0" in err[0], done.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_the_dequantized_weight_in_flight_is_charged(gguf_file: Path) -> None:
    """Each block's forward and backward charge the weight its matmuls dequantize, one projection at a time: its
    largest, in the matmul's dtype, as a real dequantized weight takes (the planner prices the same: the tests
    of planner = ledger = dry run hold with it). For Llama-3.1-8B in bf16 that is 112 MiB."""
    eight_b = dequantized_bytes(PRESETS["llama-3.1-8b"], LoraConfig(rank=8, load_in_4bit=True), "block.0", 2)
    assert eight_b == 112 * 2**20
    trainer = StreamingTrainer.from_pretrained(gguf_file, _settings(grad_accum=2))
    seen: list[tuple[str, str, int]] = []
    allocate = trainer.ledger.allocate

    def spy(category: str, layer: str, nbytes: int, what: str = "") -> int:
        if "dequantized" in what:
            seen.append((category, layer, nbytes))
        return allocate(category, layer, nbytes, what)

    trainer.ledger.allocate = spy  # type: ignore[method-assign]  # records the charges as the runtime makes them
    trainer.step(torch.randint(0, 300, (2, 16)))
    largest = trainer.tc.lora.gguf.type_of("model.layers.0.mlp.down_proj.weight")
    blocks = trainer.layouts["block.0"].packed
    pieces = blocks.views(torch.zeros(trainer.layouts["block.0"].numel, dtype=torch.uint8))
    weight = blocks.quant.dequantize({"weight": torch.zeros(256, row_bytes(largest, 512), dtype=torch.uint8),
                                      "ggml_type": torch.tensor([TYPE_IDS[largest]], dtype=torch.uint8)}, (256, 512))
    assert "mlp.down_proj.weight" in pieces
    nbytes = weight.numel() * weight.element_size()  # the (256, 512) down_proj, in fp32
    # a forward and a backward of each block in each of the two micro-batches
    assert sorted(seen) == sorted([("workspace", f"block.{i}", nbytes) for i in range(2)] * 4)
    trainer.close()


# One tiny model of each architecture the base reads beside Llama, as transformers configures it from the file: what
# transformers' GGUF loading reads of each (Qwen3's head_dim is its class default, 128: the file's key_length is not
# read for it; a Phi-3 file names its pad token, which the class defaults to 32000).
ARCHITECTURES = {
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=128, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=128, max_position_embeddings=128, tie_word_embeddings=True),
    "phi3": lambda: transformers.Phi3Config(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=128, bos_token_id=260, eos_token_id=261, pad_token_id=261,
        tie_word_embeddings=False),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=64, max_position_embeddings=128, sliding_window=8),
    # (transformers reads no expert width from the file: its class default, 768, is the model's)
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=768, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=64, max_position_embeddings=128, tie_word_embeddings=False),
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_equals_transformers_gguf_loading(tmp_path: Path, arch: str) -> None:
    """Every tensor equals transformers' `gguf_file=` model of the same file exactly (the kept blocks dequantized,
    Gemma's norms less one); the loss within twice transformers' own eager-vs-sdpa difference; a LoRA step runs."""
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", config=ARCHITECTURES[arch]())
    checkpoint = GGUFCheckpoint.open(path)
    assert checkpoint.config.model_type == {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}.get(arch, arch)
    assert {t for _, t in checkpoint.base().types} >= {"Q4_0", "Q4_K", "Q8_0"}
    models = {attn: transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.float32, attn_implementation=attn)
              for attn in ("eager", "sdpa")}
    with StreamingTrainer.from_pretrained(path, _settings(lr=1e-2, lora_targets="")) as trainer:
        ours, theirs = trainer.state_dict(), models["eager"].state_dict()
        assert set(ours) == set(theirs)
        for key, value in ours.items():
            torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, msg=key)
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            losses = {attn: m(ids, labels=ids).loss.double().item() for attn, m in models.items()}
        noise = abs(losses["sdpa"] - losses["eager"])
        assert abs(trainer.evaluate(ids) - losses["eager"]) <= 2 * max(noise, 1e-6), (losses, noise)
        assert np.isfinite(trainer.step(ids))


def test_streamer_train_reads_a_phi3_gguf_file_with_its_tokenizer(tmp_path: Path) -> None:
    """The command line on an architecture other than Llama's (fused qkv and gate-up projections): the file's
    tokenizer and a LoRA step."""
    path = write_gguf(tmp_path / "tiny-phi3.gguf", config=ARCHITECTURES["phi3"]())
    data = tmp_path / "data.txt"
    data.write_text("hello world\n" * 40)
    done = _cli("train", "--from-pretrained", path, "--data", data, "--lora-rank", "4", "--steps", "1", "--seq", "16",
                "--batch", "2", "--sample-tokens", "0", "--eval-every", "0", "--eval-fraction", "0", "--run-dir",
                tmp_path / "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 1/1 loss" in done.stdout


def test_streamer_train_reads_a_mixture_gguf_file_with_lora_on_its_experts(tmp_path: Path) -> None:
    """A Qwen3-MoE file through the command line: its tokenizer, adapters on every projection (the experts' fused
    tensors, kept as the file's blocks, too), a LoRA step; planner = ledger = dry run on it."""
    from layers import FAMILIES

    path = write_gguf(tmp_path / "tiny-qwen3moe.gguf", config=ARCHITECTURES["qwen3moe"]())
    targets = ",".join(FAMILIES["qwen3_moe"].example().lora().projections)
    data = tmp_path / "data.txt"
    data.write_text("hello world\n" * 40)
    done = _cli("train", "--from-pretrained", path, "--data", data, "--lora-rank", "4", "--lora-targets", targets,
                "--steps", "1", "--seq", "16", "--batch", "2", "--sample-tokens", "0", "--eval-every", "0",
                "--eval-fraction", "0", "--run-dir", tmp_path / "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 1/1 loss" in done.stdout
    # The merged export is the model it trained: the file's experts dequantized, the adapters added.
    done = _cli("export", tmp_path / "run", tmp_path / "merged", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    from streamer.cli.generate import open_trainer
    from streamer.run_dir import RunDir

    with open_trainer(RunDir(tmp_path / "run")) as trainer:
        expected = trainer.state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in merged)
    checkpoint = GGUFCheckpoint.open(path)
    assert {k.rsplit(".", 1)[-1] for k, _ in checkpoint.base().types} >= {"gate_up_proj", "down_proj"}
    tc = _settings(lora_targets=targets, activations="checkpoint")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer.from_pretrained(path, tc, tmp_path / "planned") as trainer:
        trainer.step(ids)
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
        host, tc = trainer.store.spec.host_bytes()[0], trainer.tc
    predicted = plan(checkpoint.config, device_spec("h100-sxm"), tc.plan_config(2, 16))
    assert (predicted.peak_device_bytes, predicted.peak_breakdown) == real
    assert predicted.host_store_bytes == host


def test_an_unread_gguf_architecture_is_one_line(tmp_path: Path) -> None:
    """A file of an architecture the base does not read is one line naming it; so is a Mixtral file ("llama" with
    experts), which transformers reads as a dense Llama, and a Qwen3-MoE file whose experts' width is not the one
    transformers takes (it reads none from the file)."""
    data = tmp_path / "data.txt"
    data.write_text("hello world\n" * 20)
    config = ARCHITECTURES["qwen3moe"]()
    config.moe_intermediate_size = 256
    path = write_gguf(tmp_path / "narrow.gguf", config=config)
    done = _cli("train", "--from-pretrained", path, "--data", data, "--lora-rank", "4", "--run-dir",
                tmp_path / "run", cwd=tmp_path)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "experts are 256 wide" in err[0] and "768" in err[0], err
    assert not (tmp_path / "run").exists()
    for arch, expected in (("qwen2moe", "GGUF architecture 'qwen2moe' is not read"),
                           ("llama", "a GGUF 'llama' file with experts (a Mixtral) is not read")):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(2)
        writer.add_expert_count(4)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        done = _cli("train", "--from-pretrained", path, "--data", data, "--lora-rank", "4", "--run-dir",
                    tmp_path / "run", cwd=tmp_path)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1 and expected in err[0], done.stderr[-2000:]
        assert not (tmp_path / "run").exists()


def test_a_tensor_read_into_bf16_is_dequantized_rows_at_a_time_bit_for_bit(
        gguf_file: Path, reference: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the base holds dequantized (the embedding, the head, the norms) is read into bf16 a few rows at a
    time, each block cast as it comes: the values of gguf's float32 read whole, then cast, to the bit. A bf16 run
    stores them so: transformers' values in bf16."""
    import streamer.io.gguf as gguf_reader

    checkpoint = GGUFCheckpoint.open(gguf_file)
    keys = [key for key in checkpoint._tensors if not key.startswith("model.layers.") or key.endswith("norm.weight")]
    whole = {key: checkpoint.read(key) for key in keys}
    monkeypatch.setattr(gguf_reader, "DEQUANTIZE_NUMEL", 7 * 256)  # seven rows of 256 at a time, the last fewer
    for key in keys:
        read = checkpoint.read(key, torch.bfloat16)
        assert read.dtype == torch.bfloat16 and torch.equal(read, whole[key].to(torch.bfloat16)), key
    assert whole["model.embed_tokens.weight"].shape[0] % 7  # (a short last block)
    # numpy's buffers (tracemalloc traces them): the tensor's bytes as the file holds them (its rows, a copy), and
    # one block in float32 at a time, not the whole tensor in float32 too (which doubled this peak).
    tracemalloc.start()
    checkpoint.read("model.embed_tokens.weight", torch.bfloat16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= checkpoint._blocks("model.embed_tokens.weight").nbytes + 2 * 7 * 256 * 4, peak
    trainer = StreamingTrainer.from_pretrained(gguf_file, _settings(dtype="bf16"))
    ours, theirs = trainer.state_dict(), reference.state_dict()
    for key in keys:
        assert torch.equal(ours[key], theirs[key].to(torch.bfloat16).float()), key
    trainer.close()
