"""docs/ADDING_A_FAMILY.md, followed: its toy family's files, taken from the page, are written into a temporary
folder and registered the way the page says; then the family battery of tests/test_families.py runs on it."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterator

import pytest
import transformers

import layers
from layers import FAMILIES, PRESETS
from tests import test_families as battery

ROOT = Path(__file__).resolve().parent.parent
HOW_TO = ROOT / "docs" / "ADDING_A_FAMILY.md"


def page_files() -> dict[str, str]:
    """The page's code blocks that start with a `# path` line: path -> text."""
    blocks = re.findall(r"```python\n# (\S+\.py)\n(.*?)```", HOW_TO.read_text(), flags=re.S)
    return {path: text for path, text in blocks}


class ToyHFConfig(transformers.LlamaConfig):
    model_type = "toy_llama"


class ToyHFModel(transformers.LlamaForCausalLM):
    config_class = ToyHFConfig


@pytest.fixture
def toy_family(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The page's toy family written out and registered, and a transformers class for its model_type; the
    registry and the imported modules as they were afterwards."""
    folder = tmp_path_factory.mktemp("families")
    for path, text in page_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    if "toy_llama" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        transformers.AutoConfig.register("toy_llama", ToyHFConfig)
        transformers.AutoModelForCausalLM.register(ToyHFConfig, ToyHFModel)
    families, presets = dict(FAMILIES), dict(PRESETS)
    monkeypatch.syspath_prepend(str(folder))
    try:
        assert layers.load_family("toy_llama") == ["ToyLlamaConfig"]
        yield "toy_llama"
    finally:
        FAMILIES.clear()
        FAMILIES.update(families)
        PRESETS.clear()
        PRESETS.update(presets)
        for name in [m for m in sys.modules if m == "toy_llama" or m.startswith("toy_llama.")]:
            del sys.modules[name]


def test_the_page_gives_a_whole_family() -> None:
    """The toy's files are a family folder's, less the costs it reuses; the in-tree line the page names has the
    form of FAMILY_PACKAGES' entries, and each of those is a folder with a family's four files."""
    assert sorted(page_files()) == ["toy_llama/__init__.py", "toy_llama/config.py", "toy_llama/units.py"]
    assert '`"layers.toy_llama",`' in HOW_TO.read_text()
    for package in layers.FAMILY_PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        assert {"__init__.py", "config.py", "costs.py", "units.py"} <= {p.name for p in folder.glob("*.py")}, package
    folders = {p.parent.name for p in (ROOT / "layers").glob("*/config.py")}
    assert folders == {package.split(".")[1] for package in layers.FAMILY_PACKAGES}


def test_the_toy_family_passes_the_family_battery(toy_family: str, capsys, tmp_path: Path,
                                                  tiny_setup: Path) -> None:
    """Registered, the toy is one of the families: every check tests/test_families.py runs per family."""
    assert FAMILIES[toy_family].example().model_type == toy_family
    battery.test_the_family_is_its_transformers_class(toy_family)
    battery.test_logits_and_gradients_equal_transformers_within_its_fp32_noise(toy_family)
    battery.test_streamed_training_equals_transformers_and_adamw(tmp_path / "train", toy_family)
    battery.test_cli_trains_a_transformers_folder_exports_and_generates(capsys, tmp_path / "cli", tiny_setup,
                                                                        toy_family)
    for dtype, activations, store, lora in [("fp32", "resident", "ram", 0), ("bf16", "checkpoint", "disk", 0),
                                            ("bf16", "resident", "ram", 4)]:
        battery.test_planner_dry_run_and_real_run_agree_to_the_byte(tmp_path / f"bytes-{dtype}-{store}-{lora}",
                                                                    toy_family, dtype, activations, store, lora)
    battery.test_lora_on_every_projection_exports_what_peft_loads(capsys, tmp_path / "lora", tiny_setup, toy_family)
    battery.test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path / "resume", toy_family)
