"""QLoRA's targets, planned by `streamer plan` as a user types it: Llama-3.1-70B (its published config.json) with a
4-bit base, batch 1 x 2048, checkpointed, on an RTX 4090, beside the same LoRA step on the 16-bit base."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from layers import ModelConfig
from memory_model import PlanConfig, device_spec, plan
from memory_model.host import frozen_slab_bytes
from memory_model.lora import LoraConfig

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
        assert sizes["embed"] == shape.vocab_size * shape.hidden_size * 2  # bf16, never quantized
