"""QLoRA's targets, planned by `streamer plan` as a user types it: Llama-3.1-70B (its published config.json) with a
4-bit base, batch 1 x 2048, checkpointed, on an RTX 4090, beside the same LoRA step on the 16-bit base. And the
documented commands that QLoRA the files users bring: a hub "-bnb-4bit" folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from layers import ModelConfig
from memory_model import PlanConfig, device_spec, plan
from memory_model.host import frozen_slab_bytes
from memory_model.lora import LoraConfig
from streamer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
SEVENTY_B = ROOT / "tests" / "hub_configs" / "llama-3.1-70b.json"
QLORA = ("--model", SEVENTY_B, "--target", "rtx4090", "--batch", "1", "--seq", "2048", "--activations", "checkpoint",
         "--lora-rank", "16", "--load-in-4bit", "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant")
GiB = 2**30


def _plan(*args: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "streamer", "plan", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _json(*args: object) -> dict[str, Any]:
    return json.loads(_plan(*args, "--json").stdout)


def test_seventy_b_qlora_fits_a_4090_on_either_tier_at_under_a_third_of_the_16_bit_links_bytes():
    """Device: the allocated peak fits the 4090's 24 GB less its reserve, and the dry run's ledger is the plan's.
    Host: at most 48 GiB on the RAM tier, 8 GiB on the disk tier. Link: at most 0.3x the 16-bit base's step."""
    ram = _json(*QLORA, "--store", "ram", "--dry-run")
    disk = _json(*QLORA, "--store", "disk")
    for p in (ram, disk):
        assert p["fits"] and p["host_fits"] and p["does_not_fit"] is None
        assert p["device"] == "rtx4090" and p["allocated_peak_bytes"] < 24 * 10**9
    assert ram["dry_run_peak_device_bytes"] == ram["peak_device_bytes"]
    assert ram["host_peak_bytes"] <= 48 * GiB, ram["host_peak"]
    assert disk["host_peak_bytes"] <= 8 * GiB, disk["host_peak"]
    assert disk["host_peak"]["store"] == 0 and disk["disk_read_bytes_per_step"] > 0
    for p in (ram, disk):
        sixteen = p["base_16bit"]
        link = p["h2d_bytes_per_step"] + p["d2h_bytes_per_step"]
        assert p["base_16bit"]["link_ratio"] == link / sixteen["link_bytes_per_step"] <= 0.3
        assert sixteen["host_store_bytes"] > 3 * p["host_store_bytes"]
    # On the disk tier each load reads its unit's slab as stored: what crosses the link, on either base.
    assert disk["disk_read_bytes_per_step"] == disk["h2d_bytes_per_step"]
    assert disk["base_16bit"]["disk_read_bytes_per_step"] == disk["base_16bit"]["link_bytes_per_step"]


def test_plan_prints_the_4_bit_plan_beside_the_16_bit_one_and_the_baseline():
    out = _plan(*QLORA, "--store", "disk").stdout
    table = out[out.index("the quantized base beside a 16-bit one"):]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == [
        "4-bit nf4 (double quant) (this plan)", "16-bit (bf16)", "16 B/param baseline (weights, gradients, Adam)"]
    assert "(1.00x)" in rows[1] and "1.03 TiB" in rows[2]


def test_a_frozen_base_stages_one_buffer_of_each_slab_size():
    """On an accelerator a frozen base's loads are all that cross the staging pool (no gradient, master or moments
    do): one buffer of each unit slab's size, the embedding's, a block's and the head's, and no more."""
    shape = ModelConfig.from_hf(SEVENTY_B)
    for lora in (LoraConfig(rank=16), LoraConfig(rank=16, load_in_4bit=True, bnb_4bit_quant_type="nf4")):
        cfg = PlanConfig.of(1, 2048, lora=lora, compute_dtype="bf16", activations="checkpoint", store="disk")
        sizes = {u: frozen_slab_bytes(shape, cfg, u) for u in ("embed", "block.0", "head")}
        staging = plan(shape, device_spec("rtx4090"), cfg, limits=False).host_peak.staging
        assert staging == sum(sizes.values())
        # The runtime's pool is bounded by the same bytes (what --pin-memory staging pins).
        tc = TrainerConfig.of(dtype="bf16", store="disk", lora_rank=16, load_in_4bit=lora.load_in_4bit,
                              bnb_4bit_quant_type=lora.bnb_4bit_quant_type)
        assert tc.store_spec(shape).staging_bytes() == staging
        assert sizes["embed"] == shape.vocab_size * shape.hidden_size * 2  # bf16, never quantized


def write_bnb_4bit(hf_folder: Path, out: Path, tokenizer: Path | None = None) -> Path:
    """A hub "-bnb-4bit" folder as transformers saves one: `hf_folder` loaded 4-bit (nf4, double quant), saved
    with its quantization_config and the pieces of each weight; the tokenizer's files beside it."""
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, quantization_config=config,
                                                              dtype=torch.float32, device_map="cpu")
    model.save_pretrained(out)
    for path in (tokenizer or hf_folder).iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (out / path.name).write_bytes(path.read_bytes())
    return out


def test_the_documented_command_trains_lora_on_a_hub_bnb_4bit_folder(tmp_path, tiny_hf_model, tiny_setup):
    """docs/CLI.md's command for a folder saved 4-bit (its stand-in, as the docs test makes it), through the
    documented override, trains LoRA on the folder's 4-bit base and writes nothing of it back."""
    import dataclasses

    from conftest import TINY_RUN_MODEL
    from streamer.io.tokenizer import load_tokenizer
    from tests.test_documented_commands import file_commands, override

    command = next(c for where, c in file_commands() if where == "CLI.md" and "BNB4_DIR" in c)
    hf = tmp_path / "hf"
    tiny_hf_model(dataclasses.replace(TINY_RUN_MODEL, n_positions=128)).save_pretrained(hf)
    load_tokenizer(tiny_setup / "tok").save(hf)
    bnb4 = write_bnb_4bit(hf, tmp_path / "bnb-4bit")
    assert json.loads((bnb4 / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"hello {i} world", "completion": " hi"}) + "\n" for i in range(40)))
    (tmp_path / "run").mkdir()
    stand_ins = {"run": tmp_path / "run", "data": data, "toml": data, "gguf": data, "pairs": data, "hf": hf,
                 "bnb4": bnb4}
    (tmp_path / "work").mkdir()
    argv = override(command, stand_ins, tmp_path / "work")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path / "work", timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    settings = (tmp_path / "work" / "runs" / "qlora-hub" / "config.toml").read_text()
    assert 'load_in_4bit = true\nbnb_4bit_quant_type = "nf4"\nbnb_4bit_use_double_quant = true' in settings
    assert "store files, last step: read" in done.stdout and "written 0 B" in done.stdout
