"""Helpers shared by the test files."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import pytest
import torch

from layers import FAMILIES, GPTJConfig

if TYPE_CHECKING:
    import transformers

    from crash_driver import Job
    from streamer import TrainerConfig

# pytest-xdist's workers share the cores, and so do the commands they start (which inherit this variable). With
# torch's default of one intra-op thread per core, each core holds several threads that spin at every barrier,
# and a small op waits for a descheduled one: on 2 cores, steps ran 3-10x slower than alone. (A worker's plugins
# may have imported torch already, so its own count is set too.)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", str(_share))))


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter with seeded noise of roughly unit-activation scale.

    HF's init leaves biases at zero, LayerNorms at identity and matrices at std 0.02,
    which makes attention almost uniform: a parity test on such weights could not see
    a wrong bias, LayerNorm affine or rotary.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("wte.weight"):  # unit scale: every block normalises it with ln_1
                p.copy_(noise)
            elif p.ndim == 2:  # Linear (out, in): fan-in scaling keeps activations near unit size
                p.copy_(noise / p.shape[1] ** 0.5)
            elif name.endswith("weight"):  # LayerNorm gain
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)


TINY_RUN_MODEL = GPTJConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
# DPO's and GRPO's checkpoint (`llama_folder`): a vocabulary the Qwen-style test tokenizer fits.
PREFERENCE_CFG = dataclasses.replace(FAMILIES["llama"].example(), vocab_size=448, max_position_embeddings=64)


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """For fast `streamer train` runs: TINY_RUN_MODEL's config.json, train.txt and a tokenizer folder tok/."""
    from pydoc_data.topics import topics

    from streamer.io.tokenizer import train_bpe
    root = tmp_path_factory.mktemp("tiny")
    (root / "config.json").write_text(json.dumps(TINY_RUN_MODEL.adapter().to_hf()))
    texts = [topics[k] for k in sorted(topics)[:30]]
    (root / "train.txt").write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts))
    train_bpe(texts, vocab_size=TINY_RUN_MODEL.vocab_size).save(root / "tok")
    return root


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama (`PREFERENCE_CFG`) as transformers saves it, with a Qwen-style tokenizer: the checkpoint DPO's
    and GRPO's tests train and hold against TRL. Nothing writes into it."""
    from tests.test_data_cli import write_tokenizer
    from tests.test_families import hf_model

    folder = tmp_path_factory.mktemp("preference") / "hf"
    hf_model(PREFERENCE_CFG).save_pretrained(folder)
    write_tokenizer(folder, "qwen")
    return folder


@pytest.fixture(scope="session")
def tiny_hf_model() -> Callable[..., "transformers.GPTJForCausalLM"]:
    """Factory: `tiny_hf_model(cfg, seed=0)` -> the transformers model of cfg's model_type (GPTJForCausalLM,
    LlamaForCausalLM, ...; eager attention, eval mode, random weights)."""
    import transformers  # imported here so that test files without HF do not pay for it

    def build(cfg: GPTJConfig, seed: int = 0) -> transformers.GPTJForCausalLM:
        hf_cfg = transformers.AutoConfig.for_model(**cfg.adapter().to_hf(), attn_implementation="eager")
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
        randomize_(model, seed)
        return model

    return build


def poison_gradient(monkeypatch: pytest.MonkeyPatch, unit: str, value: float = float("inf")) -> None:
    """Every gradient of `unit` that reaches the host store gets `value` in its first element."""
    from streamer.store.host import HostStore
    original = HostStore.accumulate_grad

    def poisoned(self, name, grads, *args, **kwargs):
        if name == unit:
            grads = [g.clone() for g in grads]
            grads[0].view(-1)[0] = value
        return original(self, name, grads, *args, **kwargs)

    monkeypatch.setattr(HostStore, "accumulate_grad", poisoned)


DEBUG_MODEL = GPTJConfig.preset("gptj-debug")


def debug_batches(n: int, seed: int = 3) -> list[torch.Tensor]:
    """`n` batches of 2 x 16 random tokens for DEBUG_MODEL."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, DEBUG_MODEL.vocab_size, (2, 16), generator=g) for _ in range(n)]


def strided_sequences(n: int, seed: int) -> torch.Tensor:
    """`n` sequences of 32 DEBUG_MODEL tokens, each a random start and stride: data a tiny model learns."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, DEBUG_MODEL.vocab_size, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(32)) % DEBUG_MODEL.vocab_size


class DebugRun(NamedTuple):
    losses: list[float]
    weights: dict[str, torch.Tensor]
    step_bytes: tuple[int, int]  # the last step's store bytes (read, written)
    redos: int  # steps made again after the backward
    norms: list[float]  # each step's gradient norm


def train_debug(root: Path, tc: "TrainerConfig", steps: int = 4, monkeypatch: pytest.MonkeyPatch | None = None,
                poisoned_step: int | None = None) -> DebugRun:
    """DEBUG_MODEL trained on `debug_batches(steps)` in a store at `root`; at `poisoned_step`, a NaN in block.1's
    gradient (`poison_gradient`, through `monkeypatch`)."""
    from streamer import StreamingTrainer
    norms = []
    with StreamingTrainer(DEBUG_MODEL, tc, store_dir=root) as trainer:
        for step, ids in enumerate(debug_batches(steps)):
            if step == poisoned_step:
                with monkeypatch.context() as patch:
                    poison_gradient(patch, "block.1", float("nan"))
                    trainer.step(ids)
            else:
                trainer.step(ids)
            norms.append(sum(trainer.executor.grad_sq_norms.values()) ** 0.5)
        return DebugRun(trainer.losses, trainer.state_dict(), trainer.step_bytes, trainer.clipped_redos, norms)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit for bit: the same keys, and torch.equal under each."""
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def forkserver() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # Not crash_driver itself: Python 3.11's forkserver preloads without the test folder on sys.path.
    # torch._dynamo: the first op on a meta tensor (building a unit) imports it, ~0.7 s per child otherwise.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "layers", "streamer"])
    return ctx


def run_child(ctx: Any, job: "Job", kill_after: float | None = None) -> int:
    """tests/crash_driver.py's `train(job)` in a child of the `forkserver` fixture's context: its exit code (-9:
    SIGKILL); `kill_after` seconds: killed from here at that time."""
    import crash_driver
    process = ctx.Process(target=crash_driver.train, args=(job,))
    process.start()
    process.join(kill_after if kill_after is not None else 120)
    if process.is_alive():
        assert kill_after is not None, "the child hung"
        process.kill()
        process.join()
    return process.exitcode


# The longest tests start first: with two workers, neither is then left running one of them alone at the end.
LONGEST_FIRST = ("test_every_documented_command_runs", "test_every_setting_combination_trains_and_agrees",
                 "test_quick_run_writes_every_section")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.originalname not in LONGEST_FIRST)
