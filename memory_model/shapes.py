"""The plan's settings, and the per-unit byte and FLOP formulas the planner adds up for a model's shape
(layers.config.ModelConfig, each family's: the one place that counts a model's parameters).

The activation formulas are measured, not guessed: tests/test_planner.py runs layers.GPTJBlock /
GPTJHead / GPTJEmbedding under `saved_tensors_hooks` and checks these against the unique storages autograd
saves (weights excluded, as the runtime packs those as handles). Derivation in docs/MEMORY_MODEL.md.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, replace
from typing import Any

from layers.config import ModelConfig
from memory_model.lora import LoraConfig, target_shape, targets_of
from memory_model.objective import ObjectiveConfig
from memory_model.settings import Choice, Integer, SettingError, Switch, branch, build, check_settings, setting
from memory_model.step import StepConfig
from memory_model.units import DTYPE_BYTES, Precision, stored_bytes

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights, exp_avg, exp_avg_sq
GRAD_ACCUM_BYTES_PER_PARAM = 4  # the host's fp32 gradient accumulator, streamed in with the optimizer state
# AdamW reads master, grad, exp_avg, exp_avg_sq and writes master, exp_avg, exp_avg_sq: 7 fp32 words per
# parameter (calibrate.py measures the `local` update bandwidth with the same count; PlanConfig's
# update_touched_bytes counts the moments as stored).
UPDATE_TOUCHED_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class PlanConfig:
    """One training step's settings as the planner prices it: the step's own (`step`, the trainer's too, its dtypes
    with it, the compute dtype resolved: bf16 by default), and the batch, devices and LoRA. `batch` is the step's
    global batch: grad_accum micro-batches on each of `devices` data-parallel devices, so batch must divide evenly
    by grad_accum * devices. `of` and `replace` take every setting by its flat name (its flag's):
    `PlanConfig.of(batch=8, seq=2048, store="disk")`; the compute dtype's is `compute_dtype`."""

    batch: int = setting(MISSING, "sequences per optimizer step (the global batch)", Integer())
    seq: int = setting(MISSING, "tokens per sequence", Integer())
    step: StepConfig = branch(StepConfig, lambda: StepConfig(precision=Precision("bf16")),
                              names={"dtype": "compute_dtype"})
    devices: int = setting(1, "data-parallel processes, one device each", Integer())
    ranks_per_node: int = setting(
        8, "data-parallel devices on one machine: more span several, and the gradient sum crosses the network "
           "between them (default: an 8-GPU server, DGX or HGX)", Integer())
    packed: bool = setting(False, "rows of packed examples (streamer train --pack): each block also keeps its "
                                  "attention mask and its rows' rotary tables", Switch())
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank 0: full fine-tuning
    source_dtype: str = setting("fp32", "the dtype of a model's units as the run's start holds them before "
                                        "storing them: fp32 for a fresh initialisation; an import's, its "
                                        "checkpoint's widest", Choice(("fp32", "bf16", "fp16")), "DTYPE")
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # DPO: pairs of rows, and its loss's bytes

    def __post_init__(self) -> None:
        check_settings(self)
        step = self.step
        if self.batch % (step.grad_accum * self.devices):
            raise ValueError(f"batch {self.batch} does not split into grad_accum={step.grad_accum} micro-batches "
                             f"on devices={self.devices}; use a multiple of {step.grad_accum * self.devices}")
        if not step.precision.resolved:
            raise SettingError("compute_dtype", "must be bf16 or fp32 to plan a step in, not auto: resolve it for "
                                                "the device first")
        step.fused(self.devices, self.lora.enabled)  # an impossible "fused" fails here
        if step.update_timing == "overlapped" and step.update_on != "host":
            raise SettingError("update_timing", "overlapped overlaps a host update with the backward: add "
                                                "--update-on host, or use --update-timing auto")

    @classmethod
    def of(cls, batch: int, seq: int, lora: LoraConfig = LoraConfig(), **flat: Any) -> "PlanConfig":
        """A step of `batch` sequences of `seq` tokens, its other settings by flat name, each else its default."""
        return build(cls, flat, cls(batch, seq, lora=lora))

    def replace(self, lora: LoraConfig | None = None, **flat: Any) -> "PlanConfig":
        """These settings with some changed, by flat name: `cfg.replace(update_timing="after-backward")`."""
        return build(type(self), flat, self if lora is None else replace(self, lora=lora))

    @property
    def fused(self) -> bool:
        """The update runs inside the last micro-batch's backward (`StepConfig.fused`)."""
        return self.step.fused(self.devices, self.lora.enabled)

    @property
    def shards(self) -> int:
        """The slices each unit's state is stored in, one per device (1: every device stores it whole)."""
        return self.step.shards(self.devices)

    @property
    def nodes(self) -> int:
        """Machines the devices span, `ranks_per_node` on each (the last may hold fewer)."""
        return -(-self.devices // self.ranks_per_node)

    @property
    def reference_in_step(self) -> bool:
        """The step's forward runs the reference model too (ObjectiveConfig.reference_in_step: DPO with LoRA)."""
        return self.objective.reference_in_step(self.lora.enabled)

    @property
    def micro_batch(self) -> int:
        """Sequences in one micro-batch on one device."""
        return self.batch // (self.step.grad_accum * self.devices)

    @property
    def precision(self) -> Precision:
        """The step's dtypes (`StepConfig.precision`)."""
        return self.step.precision

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.precision.compute]

    def moment_bytes(self, numel: int) -> int:
        """Both Adam moments of `numel` parameters (one update chunk, or a unit) in the store."""
        return 2 * stored_bytes(self.precision.moments, numel)

    @property
    def master_bytes(self) -> int:
        """Per parameter, the master weights in the store."""
        return DTYPE_BYTES[self.precision.master]

    @property
    def compute_is_master(self) -> bool:
        return self.precision.compute_is_master(self.lora.enabled)

    def store_bytes(self, numel: int) -> int:
        """What an update of `numel` parameters writes back: the master, the moments, the new compute weights."""
        return numel * (self.master_bytes + self.new_compute_bytes) + self.moment_bytes(numel)

    def update_touched_bytes(self, numel: int) -> int:
        """AdamW reads master, gradient and moments and writes master and moments, as stored (28 B/param in
        fp32)."""
        return numel * (2 * self.master_bytes + 4) + 2 * self.moment_bytes(numel)

    @property
    def new_compute_bytes(self) -> int:
        """Per parameter, the compute-dtype copy an update writes; none where the master is the compute weights
        (one dtype), and none with the compute weights on disk, whose loads cast the master (a copy would cost its
        bytes on every step)."""
        return 0 if self.compute_is_master or not self.step.store.compute.zero_copy else self.dtype_bytes


def norm_first_allowed(fused: bool, grad_accum: int) -> bool:
    """Whether a step that clips can be made norm-first: a norm pass, then the fused step with the clip
    coefficient known. It needs the fused update (not LoRA's, not several processes) and one micro-batch: the
    norm of a gradient summed over micro-batches needs the accumulator the fused step avoids writing."""
    return fused and grad_accum == 1


def check_norm_first(clipped_steps: str, fused: bool, grad_accum: int) -> None:
    """An explicit `norm-first` where it cannot run fails here, in one line naming the flags."""
    if clipped_steps == "norm-first" and not norm_first_allowed(fused, grad_accum):
        why = "--grad-accum 1" if fused else "the fused update (--store disk, one process, no LoRA)"
        raise SettingError("clipped_steps", f"norm-first runs a clipping step as a norm pass and a fused step, so "
                                            f"it needs {why}; use --clipped-steps auto or after-backward")


# --- activations: what autograd saves, per unit and micro-batch (B sequences of T tokens) ------------------
# es is the compute dtype's size. On the cpu: LayerNorm keeps mean and rstd in the input dtype, and SDPA takes
# its flash path for both dtypes, saving q, k, v, the output and an fp32 logsumexp (never the T x T scores).

def rotary_bytes(shape: ModelConfig, es: int) -> int:
    """The element size of the sin/cos tables a block rotates with: the compute dtype's, or fp32 where the
    family rotates in fp32 (`ModelConfig.rotary_fp32`)."""
    return 4 if shape.rotary_fp32 else es


def rotary_shared(shape: ModelConfig, es: int, packed: bool) -> bool:
    """Whether blocks save the same sin/cos storages (fp32, unpacked): one per table (`AttentionLayout.rotary_table`),
    charged once, to the first block that saves it."""
    return rotary_bytes(shape, es) == 4 and not packed


def rotary_table_bytes(shape: ModelConfig, seq: int, es: int, batch: int = 1, packed: bool = False) -> int:
    """sin and cos. In bf16 each block casts its own (T, R/2) copies; in fp32 the cast is a no-op and the
    saved tensors are views of the cached (n_positions, R/2) tables, one storage for the whole model. Packed
    rows: each block gathers its own (B, T, R/2) tables at the rows' positions."""
    half, rs = shape.rotary_dim // 2, rotary_bytes(shape, es)
    if packed:
        return 2 * batch * seq * half * rs
    return 2 * shape.max_position_embeddings * half * 4 if rs == 4 else 2 * seq * half * rs


def mask_bytes(batch: int, seq: int, es: int, packed: bool, window: int | None = None) -> int:
    """A block's attention mask: SDPA turns a bool mask into a bias in the compute dtype and saves it for the
    backward, a storage of each block's own. Packed rows' is (B, 1, T, T); a sliding window shorter than the
    sequence (`window`, `AttentionLayout.window`) needs one even unpacked, (T, T)."""
    if packed:
        return batch * seq * seq * es
    return seq * seq * es if window is not None and seq > window else 0


def attention_saved_bytes(shape: ModelConfig, batch: int, seq: int, es: int, packed: bool,
                          layer_type: str, scores: bool = True) -> int:
    """What a block's attention saves besides its inputs and output: SDPA's fp32 logsumexp and any mask; with
    sinks (`ModelConfig.attention_sinks`) its softmax's probabilities over the keys and the sink, in the compute
    dtype, and, where its scores need a gradient (`scores`), its bool mask, (T, T) or packed rows' (B, 1, T, T),
    whatever the window."""
    heads = shape.num_attention_heads
    if shape.attention_sinks:
        mask = (batch if packed else 1) * seq * seq if scores else 0
        return batch * heads * seq * (seq + 1) * es + mask
    return 4 * batch * heads * seq + mask_bytes(batch, seq, es, packed, shape.attention().window(layer_type))


def block_layer_type(shape: ModelConfig, unit: str) -> str:
    """The layer type of a block unit ('block.3')."""
    return shape.attention().layer_types()[int(unit.split(".")[1])]


def block_saved_bytes(shape: ModelConfig, batch: int, seq: int, es: int, rotary: bool = True,
                      packed: bool = False, layer_type: str = "full_attention") -> int:
    """Unique storages a block's forward saves; `rotary=False` leaves out the sin/cos tables (already charged);
    `packed`: rows of packed examples (their mask and per-row rotary tables); `layer_type`: the block's (its
    window)."""
    costs = shape.costs()
    return (batch * seq * costs.block_saved_per_token(es) + costs.block_saved_fixed(es)
            + attention_saved_bytes(shape, batch, seq, es, packed, layer_type)
            + (rotary_table_bytes(shape, seq, es, batch, packed) if rotary else 0))


def frozen_block_saved_bytes(shape: ModelConfig, lora: LoraConfig, batch: int, seq: int, es: int, first: bool,
                             rotary: bool = True, packed: bool = False, layer_type: str = "full_attention") -> int:
    """What a block with frozen weights and LoRA adapters saves: only what the gradients w.r.t. its input and
    its adapters need (no matmul keeps its input for a weight gradient). `first`: its input needs no gradient
    (the block after the embedding), so only the paths from its adapters save anything."""
    n, r, plain = batch * seq, lora.rank, lora.dropout == 0
    saves = shape.costs().frozen_block_saves(es, frozenset(targets_of(shape, lora)), plain, grad_in=not first)
    total = n * saves.per_token + saves.fixed
    if saves.attention:
        total += attention_saved_bytes(shape, batch, seq, es, packed, layer_type, saves.scores)
    total += rotary_table_bytes(shape, seq, es, batch, packed) if rotary and saves.rotary else 0
    for target, input_grad in saves.input_grad.items():
        # A's output (per routed token, on a mixture's experts); the compute-dtype casts of B and (if its input
        # needs a gradient) A, every expert's
        fan_in, fan_out = target_shape(shape, target)
        experts, routed = shape.lora().experts(target)
        total += n * routed * r * es
        total += 0 if es == 4 else es * r * experts * (fan_out + (fan_in if input_grad else 0))
        # Dropout's output and, on the CPU, its scaled noise in the input's dtype (CUDA's fused kernel would
        # keep a bool mask instead: n x in bytes; not measured here).
        total += 0 if plain else n * fan_in * es * (2 if input_grad else 1)
    return total


def head_saved_bytes(shape: ModelConfig, batch: int, seq: int, es: int, vocab_chunk: int | None = None,
                     frozen: bool = False) -> int:
    """`vocab_chunk`: the loss's, loss_vocab_chunk unless given. `frozen`: the head's weights need no gradient
    (LoRA's base)."""
    n = batch * seq
    costs = shape.costs()
    return (n * costs.head_saved_per_token(es, frozen)  # the final norm's, and its output (the chunked loss's input)
            + costs.head_saved_fixed()
            + 4 * n  # each position's log-sum-exp over the vocabulary, fp32
            + 8 * n  # the shifted int64 labels (layers.loss.shift_labels: a tensor of their own)
            + _kept_logits_bytes(shape, n, vocab_chunk))


def _kept_logits_bytes(shape: ModelConfig, tokens: int, vocab_chunk: int | None = None) -> int:
    """Where one chunk holds the whole vocabulary, the loss keeps its fp32 logits for the backward instead of
    computing them again (layers.loss.chunked_lm_loss)."""
    chunk = loss_vocab_chunk(shape, tokens) if vocab_chunk is None else vocab_chunk
    return 4 * tokens * shape.vocab_size if chunk >= shape.vocab_size else 0


# fp32 logits in one vocabulary chunk of the head's loss (layers.loss.chunked_lm_loss): 128 MiB. Larger
# chunks only make fewer, wider matmuls; the full (tokens x vocab) logits never exist.
LOSS_CHUNK_LOGITS = 2**25


def loss_vocab_chunk(shape: ModelConfig, tokens: int) -> int:
    """Vocabulary rows per chunk of the head's loss for a micro-batch of `tokens` positions."""
    return max(1, min(shape.vocab_size, LOSS_CHUNK_LOGITS // max(1, tokens)))


def embed_saved_bytes(shape: ModelConfig, batch: int, seq: int) -> int:
    return 8 * batch * seq  # the int64 token ids


def block_input_numel(shape: ModelConfig, batch: int, seq: int) -> int:
    """Elements of a block's input (B, T, d): what checkpoint keeps on the device and offload in host memory."""
    return batch * seq * shape.hidden_size


def checkpoint_input_bytes(shape: ModelConfig, batch: int, seq: int, es: int) -> int:
    return block_input_numel(shape, batch, seq) * es


def offloaded_inputs_bytes(shape: ModelConfig, batch: int, seq: int, es: int) -> int:
    """Host memory offloaded activations hold at most: every block's input of one micro-batch (the micro-batches
    run one after another, each one's inputs gone by its backward's end)."""
    return shape.num_hidden_layers * checkpoint_input_bytes(shape, batch, seq, es)


# The head's backward per position (layers.loss._ChunkedLMLoss.backward): the learned mask (bool), the rows'
# scale (fp32), and a chunk's target mask (bool) and target column (int64).
HEAD_BACKWARD_BYTES_PER_TOKEN = 1 + 4 + 1 + 8


def backward_workspace_bytes(shape: ModelConfig, unit: str, batch: int, seq: int, es: int,
                             frozen: bool = False, group: int = 0) -> int:
    """Charged while a unit's backward runs. The head: one vocabulary chunk's fp32 logits gradient (unless it is the
    kept logits, charged as activations) and its compute-dtype copy, the fp32 sum of the gradient w.r.t. its input
    over the chunks, the chunk's share of it before it is added, and the positions' masks, target columns and scales
    (`HEAD_BACKWARD_BYTES_PER_TOKEN`). A block or the embedding: the incoming gradient w.r.t. its output (B, T, d);
    a trained block also autograd's buffers (`block_backward_transient_bytes`). The gradient w.r.t. a unit's input
    is charged once its backward is done, when its activations are gone: never above this moment. `frozen`: LoRA's
    base. `group`: a block's experts load `group` at a time (`expert_group`)."""
    n = batch * seq
    if unit == "head":
        chunk = loss_vocab_chunk(shape, n)
        cast = 0 if es == 4 else es  # in fp32 the cast to the compute dtype is the tensor itself
        return ((4 + cast) * n * chunk - _kept_logits_bytes(shape, n) + (4 + es) * n * shape.hidden_size
                + HEAD_BACKWARD_BYTES_PER_TOKEN * n)
    transient = block_backward_transient_bytes(shape, batch, seq, es, group) if unit != "embed" and not frozen else 0
    return n * shape.hidden_size * es + transient


def block_backward_transient_bytes(shape: ModelConfig, batch: int, seq: int, es: int, group: int = 0) -> int:
    """What a trained block's backward holds beyond its charges at its highest charged moment (its saved
    tensors, the incoming gradient and its whole weight gradient): the block's output, which the runtime
    holds until its backward ends, and at the family's busiest moment (`block_backward_peaks`) the gradients
    autograd has made so far. Measured against autograd (tests/test_backward_transient.py). None where the
    weight gradient that is charged at the end outweighs them. `group`: the block's experts load `group` at a
    time (`expert_group`), so the busiest moment is in one group's backward, whose gradient is what is charged."""
    n, costs = batch * seq, shape.costs()
    output = n * shape.hidden_size * es
    scored: tuple[tuple[int, int, int], ...]
    if group:  # the busiest moment is one group's backward, whose gradient is what is charged
        peaks, scored, charged = costs.expert_group_backward_peaks(es, group), (), group * shape.params().expert()
    else:
        peaks, scored, charged = costs.block_backward_peaks(es), costs.scores_backward_peaks(es), shape.params().block()
    scores = 2 * batch * shape.num_attention_heads * seq * (seq + 1) * es  # softmax's two gradients, whole
    busiest = max([n * per_token + es * params + fixed for per_token, params, fixed in peaks]
                  + [n * per_token + es * params + fixed + scores for per_token, params, fixed in scored])
    return max(0, output + busiest - es * charged)


# --- FLOPs ---------------------------------------------------------------------------------------------------
def step_model_flops(shape: ModelConfig, batch: int, seq: int) -> int:
    """Model FLOPs of a step over `batch` sequences: 3 x the forward's matmuls (the backward is twice the
    forward), no recompute counted: the MFU convention."""
    return 3 * sum(forward_flops(shape, u, batch, seq) for u in shape.unit_names())


def forward_flops(shape: ModelConfig, unit: str, batch: int, seq: int) -> int:
    """Matmul FLOPs of one forward. Attention counts the full T x T (QK^T and AV) although the mask makes
    half of it zeros: the usual MFU convention, and an upper bound on what a flash kernel does."""
    n, d = batch * seq, shape.hidden_size
    if unit == "embed":
        return 0  # a gather
    if unit == "head":
        return 2 * n * d * shape.vocab_size
    return 2 * n * shape.costs().block_matmul_params() + 4 * batch * seq * seq * shape.attention_width
