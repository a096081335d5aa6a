"""What a block's (and the head's) backward holds beyond the ledger's charges, measured: every storage an op makes is
tracked from its creation until its last reference dies, under a TorchDispatchMode, through a real block's forward
(or checkpoint's recompute) and backward, in the runtime's order. The formula the ledger and the planner charge
(memory_model.shapes.block_backward_transient_bytes) must equal it to the byte.

What is measured above the backward's start: its recompute's saved tensors (checkpoint; charged as
activations), the block's weight gradient (charged at the end as gradients), and the rest, which the formula
is: the gradients autograd makes as it goes, at the busiest moment, and the block's output (held by the
runtime until the backward ends, charged to nobody since the next block's backward released it).
"""
from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from layers import Gemma3TextConfig, GPTJConfig, Phi3Config, build_unit
from layers.config import ModelConfig
from layers.llama.config import LlamaConfig
from layers.olmo2.config import Olmo2Config
from layers.gpt_oss.config import GptOssConfig
from layers.moe.config import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from layers.loss import chunked_lm_loss
from memory_model.shapes import backward_workspace_bytes, block_backward_transient_bytes, loss_vocab_chunk


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages that ops made and that are still referenced: now and the peak since reset."""

    def __init__(self, untracked: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, int] = {t.untyped_storage()._cdata: 0 for t in untracked}  # e.g. the weights
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)  # torch keeps one Python storage per live StorageImpl

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def reset_peak(self) -> None:
        self.peak = self.now


def saved_storages(run):  # type: ignore[no-untyped-def]
    """run()'s result and the bytes of each storage autograd saved in it, by storage."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return run(), saved


def measured_transient(cfg: ModelConfig, dtype: torch.dtype, activations: str, batch: int, seq: int) -> int:
    """The block backward's peak above its start, less what the ledger charges in it, plus the block's output
    (live at the start, charged to nobody); never below 0, as the ledger charges nothing below its charges."""
    torch.manual_seed(0)
    block = build_unit(cfg, "block.1", "cpu").to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    weights = list(block.parameters())
    es = torch.finfo(dtype).bits // 8
    mode = LiveStorages(weights)
    with mode:
        x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype).requires_grad_()
        if activations == "resident":
            y = block(x)
        else:
            with torch.no_grad():
                y = block(x)
        incoming = torch.randn_like(x)  # charged: the previous unit's gradient w.r.t. its input
        start, existing = mode.now, set(mode.live)
        mode.reset_peak()
        recomputed = 0
        if activations != "resident":  # as the runtime: the recompute's output replaces the kept one
            y, saved = saved_storages(lambda: block(x))
            recomputed = sum(n for key, n in saved.items() if key not in existing)
        y.backward(incoming)
        del y
    weight_gradient = sum(w.grad.numel() for w in weights) * es
    output = x.numel() * es
    return max(0, mode.peak - start + output - recomputed - weight_gradient)


GPTJ = GPTJConfig(vocab_size=64, n_positions=1024, n_embd=128, n_layer=2, n_head=4, rotary_dim=16)
GPTJ_NARROW_MLP = GPTJConfig(vocab_size=64, n_positions=1024, n_embd=128, n_layer=2, n_head=4, rotary_dim=16,
                             n_inner=150)  # its busiest moment is SDPA's backward, not the MLP's
# Experts wider and narrower than the model, renormalised or not.
MOE = Qwen3MoeConfig(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=1024, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
MOE_NARROW = Qwen3MoeConfig(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=1024, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=96, norm_topk_prob=True)
OLMOE = OlmoeConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, num_experts=4, num_experts_per_tok=2)
MIXTRAL = MixtralConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        num_local_experts=4, num_experts_per_tok=2)
LLAMA = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
# OLMo 2's busiest moment is its post-MLP norm's fp32 backward; with a wide MLP, in fp32, the MLP's.
OLMO2 = Olmo2Config(vocab_size=64, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
OLMO2_WIDE_MLP = dataclasses.replace(OLMO2, intermediate_size=600)
# Fused q/k/v and gate/up projections (multi-head, as Phi-3-mini): the busiest moment is Llama's.
PHI3 = Phi3Config(vocab_size=64, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=1024, pad_token_id=0)


def gemma(d: int, f: int, heads: int, head_dim: int) -> Gemma3TextConfig:
    return Gemma3TextConfig(vocab_size=64, hidden_size=d, intermediate_size=f, num_hidden_layers=2,
                            num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim,
                            max_position_embeddings=1024, sliding_window=100)


# Gemma 3's three busiest moments: its last norm's fp32 backward, the MLP's, SDPA's (queries 4 x d wide).
GEMMA_NORM, GEMMA_MLP, GEMMA_SDPA = gemma(128, 320, 4, 32), gemma(64, 640, 4, 16), gemma(64, 64, 8, 64)


def gpt_oss(d: int, f: int, heads: int, head_dim: int, kv: int, kind: str) -> GptOssConfig:
    return GptOssConfig(vocab_size=64, hidden_size=d, intermediate_size=f, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                        max_position_embeddings=1024, sliding_window=100, num_local_experts=2, num_experts_per_tok=1,
                        attention_layers=(kind, kind))


# gpt-oss's busiest moment where its attention's scores outweigh the rest: the softmax's backward, its two
# gradients whole (T x T + 1 per head); grouped-query heads, and a window that masks some keys. With experts wider
# than the model: the clamped SwiGLU's backward.
GPT_OSS, GPT_OSS_GQA = gpt_oss(64, 32, 8, 16, 2, "full_attention"), gpt_oss(32, 48, 8, 8, 4, "full_attention")
GPT_OSS_SLIDING = gpt_oss(64, 32, 8, 16, 2, "sliding_attention")
GPT_OSS_WIDE_EXPERTS = dataclasses.replace(gpt_oss(96, 256, 2, 16, 2, "full_attention"), num_local_experts=3,
                                           num_experts_per_tok=3)


@pytest.mark.parametrize("cfg,batch,seq", [
    (GPTJ, 2, 256), (GPTJ, 1, 16), (GPTJ_NARROW_MLP, 2, 256), (LLAMA, 2, 256), (LLAMA, 1, 16),
    (GPTJConfig.preset("gptj-debug"), 2, 48), (LlamaConfig.preset("llama-debug"), 2, 48),
    (OLMO2, 2, 256), (OLMO2, 1, 16), (OLMO2_WIDE_MLP, 2, 256), (Olmo2Config.example(), 2, 24), (PHI3, 2, 256),
    (PHI3, 1, 16), (GEMMA_NORM, 2, 256), (GEMMA_MLP, 2, 256), (GEMMA_SDPA, 2, 256), (GEMMA_NORM, 1, 16),
    (MOE, 2, 256), (MOE, 4, 256), (MOE, 1, 16), (OLMOE, 4, 256), (MIXTRAL, 4, 256),
    (GPT_OSS, 2, 128), (GPT_OSS, 1, 64), (GPT_OSS_GQA, 2, 128), (GPT_OSS_SLIDING, 2, 128), (GPT_OSS, 1, 16),
    (GPT_OSS_WIDE_EXPERTS, 2, 128), (GPT_OSS_WIDE_EXPERTS, 4, 256),
], ids=["gptj-2x256", "gptj-1x16", "gptj-narrow-mlp", "llama-2x256", "llama-1x16", "gptj-debug", "llama-debug",
        "olmo2-2x256", "olmo2-1x16", "olmo2-wide-mlp", "olmo2-example", "phi3-2x256", "phi3-1x16", "gemma-norm",
        "gemma-mlp", "gemma-sdpa", "gemma-1x16", "moe-2x256", "moe-4x256", "moe-1x16", "olmoe-4x256",
        "mixtral-4x256", "gpt-oss-2x128", "gpt-oss-1x64", "gpt-oss-gqa", "gpt-oss-sliding", "gpt-oss-1x16",
        "gpt-oss-wide-experts-2x128", "gpt-oss-wide-experts-4x256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activations", ["resident", "checkpoint"])
def test_block_backward_transient_equals_autograd(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype,
                                                  activations: str) -> None:
    """Measured: equal to the byte in every case; 0 at 1 x 16, where the weight gradient outweighs it."""
    es = torch.finfo(dtype).bits // 8
    assert measured_transient(cfg, dtype, activations, batch, seq) == block_backward_transient_bytes(
        cfg, batch, seq, es)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_block_of_narrow_experts_busiest_in_its_weighting(dtype: torch.dtype) -> None:
    """Experts narrower than the model: the busiest moment is the backward of the weighting by the routing
    weights, not the experts'. Resident only: a checkpointed block's recompute holds the weighting's product
    and sum in its forward, which in bf16 is 20 bytes a token more (not modelled)."""
    es = torch.finfo(dtype).bits // 8
    assert measured_transient(MOE_NARROW, dtype, "resident", 4, 256) == block_backward_transient_bytes(
        MOE_NARROW, 4, 256, es) > 0


def test_gptj_6b_has_a_transient_at_64_x_2048_and_none_at_1_x_2048() -> None:
    """Where a block's weight gradient, charged at its backward's end, outweighs the gradients autograd makes
    before it, nothing more is charged; at a large batch the transient is gigabytes."""
    six_b = GPTJConfig.preset("gptj-6b")
    assert block_backward_transient_bytes(six_b, 1, 2048, 2) == 0
    assert 4.5 * 2**30 < block_backward_transient_bytes(six_b, 64, 2048, 2) < 5 * 2**30


def measured_head_backward(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype, frozen: bool) -> int:
    """The head loss's backward peak above its start, by storages ops make (the weight is not theirs)."""
    torch.manual_seed(0)
    weight = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype).requires_grad_(not frozen)
    mode = LiveStorages([weight])
    with mode:
        x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype).requires_grad_()
        labels = torch.randint(0, cfg.vocab_size, (batch, seq))
        loss = chunked_lm_loss(x, weight, None, labels, loss_vocab_chunk(cfg, batch * seq))
        start = mode.now
        mode.reset_peak()
        loss.backward()
    return mode.peak - start


# The whole vocabulary in one chunk (its logits kept from the forward), and in two chunks (the second smaller).
HEAD_ONE_CHUNK = dataclasses.replace(LLAMA, vocab_size=1000)
HEAD_TWO_CHUNKS = dataclasses.replace(LLAMA, vocab_size=50000, hidden_size=64)


@pytest.mark.parametrize("cfg,batch,seq", [(HEAD_ONE_CHUNK, 2, 16), (HEAD_TWO_CHUNKS, 1, 700)],
                         ids=["one-chunk", "two-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_head_backward_holds_its_workspace_and_its_gradient_only(cfg: ModelConfig, batch: int, seq: int,
                                                                 dtype: torch.dtype, frozen: bool) -> None:
    """The head's backward holds what the planner charges it (`backward_workspace_bytes`) and, when trained, its
    weight gradient, written into place: no second (vocabulary, d) product, and a frozen head (LoRA's base) makes
    none. Not charged: the loss's own fp32 scalar (4 bytes)."""
    es = torch.finfo(dtype).bits // 8
    gradient = 0 if frozen else cfg.vocab_size * cfg.hidden_size * es
    charged = backward_workspace_bytes(cfg, "head", batch, seq, es, frozen=frozen) + gradient
    assert measured_head_backward(cfg, batch, seq, dtype, frozen) - charged == 4
