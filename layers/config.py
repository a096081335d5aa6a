"""What every model family's configuration gives the generic code, and the registry of families (torch-free).

A family is a folder, `layers/<family>/`, in torchtitan's manner: `config.py`, a frozen dataclass subclassing
`ModelConfig` with transformers' own field names for its `model_type` (torch-free), and `units.py`, its torch
modules as one `layers.model.FamilyUnits`. `ModelConfig` keeps sizes and structure; what differs by family is a
facet it names or holds. It and its facets are abstract bases: what a family must define (`example()`, its units'
counts) is abstract, so a class that leaves one out cannot be built, and nothing has a stub body. Registering the class
(`@family`) puts it in `FAMILIES`, the one list the CLI, the docs' list of families and the parametrized tests
(tests/test_families.py) read. Generic code reads only the common vocabulary below, never a family's own
fields, so it never asks which family it holds:

- sizes: `vocab_size`, `hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
  `head_dim`, `intermediate_size`, `max_position_embeddings`, `rotary_dim` (the rotated dims of a head);
- `num_params()` and `unit_names()`: the model's parameters, its streamed units;
- `params()`: its parameters by unit, a `layers.params.UnitParams` beside its config (the counts of each unit,
  `embed()`, `block()`, `head()`; what a unit borrows from another, `borrowed(unit)`: a tied lm_head is the
  embedding's weight; what a unit's module uses on the device; and the experts that expert groups load,
  `experts()`, `expert()`);
- `adapter()`: how transformers names the model, a `layers.adapter.StateDictAdapter` in its family folder's
  adapter.py: its config.json read (`ModelConfig.from_hf` goes through it: the sizes it must name, `required`,
  transformers' defaults where ours differ, `defaults`, `config_fields`) and written (`to_hf()`), the checkpoint
  key of each unit's tensor (`key(unit, local_key)`, `prefix(unit)`), and how transformers saves the tensors (a
  name of their own, in parts, packed; the keys a tied checkpoint leaves out);
- `attention()`: its attention by layer, a `layers.attention.AttentionLayout` beside its config: each block's kind
  of attention, as transformers' `layer_types` names it, and per kind its `window` and what sets its RoPE tables
  (`rotary_table`); the longest sequence it attends over and the field that sets it (`context()`); the length
  past which a KV cache's rotary tables are stale (longrope's, `regime_change()`), if any;
- `example()`: a tiny model of the family with every variation it has, the one the tests run;
- `lora()`: its block's projections that LoRA's adapters may target, their shapes, those targeted by default
  (PEFT's), and where a target's adapters are, a `layers.targets.LoraTargets` in its folder's targets.py;
- `costs()`: its byte and FLOP inputs for memory_model, a facet in its folder's costs.py behind one protocol
  (`layers.costs.Costs`);
- `sparse_mlp`: a block's sparse mixture-of-experts MLP, a facet a mixture's config holds (`SparseMlp`; None:
  dense);
- `to_dict()`, our own fields, what a store's manifest records;
- `resized(...)`: a copy with some common sizes changed (a probe or a smaller model of the same shape).

`ModelConfig.from_hf` picks the family by config.json's `model_type`. It reads a config.json as transformers does:
a field the family's transformers class does not read is kept out of the model and never an error (published files
carry fields of older transformers versions and of other tools); a value that changes the math and is not
implemented here is refused in one line naming the field and the value.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Self

from layers.adapter import StateDictAdapter
from layers.attention import AttentionLayout
from layers.costs import Costs
from layers.params import UnitParams
from layers.targets import LoraTargets


class ConfigError(ValueError):
    """A configuration that cannot describe a supported model; the message names the fix."""


# model_type -> its config class, filled by each family module's `@family`.
FAMILIES: dict[str, type["ModelConfig"]] = {}
# Every family's presets by name, filled by the family modules.
PRESETS: dict[str, "ModelConfig"] = {}


# Bounds on what any machine could train, checked before anything is built per layer or per expert (a config
# naming a billion layers once took 15 GB before failing). The deepest published decoders have about 128 blocks
# (Llama 3.1 405B: 126), the most experts per block 384 (Kimi K2), the largest training state 16 B x 2T params.
MAX_LAYERS = 2048
MAX_EXPERTS = 8192
MAX_STATE_BYTES = 2**48  # 256 TiB


def family(cls: type["ModelConfig"]) -> type["ModelConfig"]:
    """Register a family's config class under its model_type (a class decorator)."""
    FAMILIES[cls.model_type] = cls
    return cls


def lora_targets() -> tuple[str, ...]:
    """Every family's projections that LoRA may target, in the families' order, each once."""
    return tuple(dict.fromkeys(name for cls in FAMILIES.values() for name in cls.lora_class.projections))


def positive_ints(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SparseMlp:
    """A block's sparse mixture-of-experts MLP, a facet its config holds (`ModelConfig.sparse_mlp`, built from the
    config's own fields, transformers' names): a router picks each token's `num_experts_per_tok` of `num_experts`
    experts, each a SwiGLU `width` wide, weighted by their softmax probabilities (renormalised over the chosen
    ones where `norm_topk_prob`). With `output_router_logits` the loss adds `router_aux_loss_coef` times
    transformers' load-balancing loss. Its units are layers/moe/units.py's, its costs layers/moe/costs.py's."""

    num_experts: int
    num_experts_per_tok: int
    width: int
    norm_topk_prob: bool
    output_router_logits: bool
    router_aux_loss_coef: float
    # Whether expert groups may carry the experts (`UnitParams.experts()`): gpt-oss's load whole.
    grouped: bool = True
    # A block's tensors whose first dimension is its experts, in its module's keys.
    keys: tuple[str, ...] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

    def __post_init__(self) -> None:
        positive_ints(self, "num_experts", "num_experts_per_tok")
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width <= 0:
            raise ConfigError(f"the experts' width must be a positive integer, got {self.width!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most the number of "
                              f"experts ({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not isinstance(self.output_router_logits, bool):
            raise ConfigError(f"output_router_logits must be true or false, got {self.output_router_logits!r}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
            raise ConfigError(f"router_aux_loss_coef must be a finite number, got {coef!r}")

    def expert_params(self, hidden_size: int) -> int:
        """One expert's parameters: its gate, up and down projections."""
        return 3 * hidden_size * self.width

    def params(self, hidden_size: int) -> int:
        """The MLP's parameters: the router, each expert's."""
        return self.num_experts * hidden_size + self.num_experts * self.expert_params(hidden_size)


class ModelConfig(abc.ABC):
    """The base of every family's frozen dataclass; see the module's docstring for what a family provides."""

    model_type: ClassVar[str]
    # Buffers that old checkpoints of the family carry and that hold no learned state.
    ignored_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ()
    # Its block's projections that LoRA may target, their shapes and keys (its folder's targets.py).
    lora_class: ClassVar[type[LoraTargets]]
    # The family's own field of each common size it stores under another name (GPT-J: hidden_size -> n_embd).
    own_names: ClassVar[dict[str, str]] = {}
    # Whether the family rotates q and k in fp32 whatever the compute dtype (its fp32 sin/cos tables are what
    # its blocks save, the cached ones shared by every block), rather than with tables cast to the compute dtype.
    rotary_fp32: ClassVar[bool] = False
    # Whether each head's softmax has a learned sink logit (gpt-oss): SDPA has none, so attention makes its scores
    # whole and saves its probabilities (memory_model.shapes.attention_saved_bytes).
    attention_sinks: ClassVar[bool] = False
    # The family's costs facet (layers/<family>/costs.py): its byte and FLOP inputs for memory_model.
    costs_class: ClassVar[type[Costs]]
    # How transformers names its model: config.json and the checkpoint's keys (its folder's adapter.py).
    adapter_class: ClassVar[type[StateDictAdapter]]
    # Its parameters by unit (beside it, in its config.py).
    params_class: ClassVar[type[UnitParams]]
    # Its attention by layer: full causal attention on every block unless the family names its own.
    attention_class: ClassVar[type[AttentionLayout]] = AttentionLayout
    vocab_size: int
    if TYPE_CHECKING:
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every family's config is a dataclass
        # A family stores each of these as a field or derives it (GPT-J's from its own names, rotary_dim from
        # head_dim): read-only to the type checker, so that either form satisfies it.
        @property
        def hidden_size(self) -> int: ...
        @property
        def num_hidden_layers(self) -> int: ...
        @property
        def num_attention_heads(self) -> int: ...
        @property
        def num_key_value_heads(self) -> int: ...
        @property
        def head_dim(self) -> int: ...
        @property
        def intermediate_size(self) -> int: ...
        @property
        def max_position_embeddings(self) -> int: ...
        @property
        def rotary_dim(self) -> int: ...
    else:
        hidden_size: int
        num_hidden_layers: int
        num_attention_heads: int
        num_key_value_heads: int
        head_dim: int
        intermediate_size: int
        max_position_embeddings: int
        rotary_dim: int
    # A block's sparse mixture-of-experts MLP, a facet a mixture's config sets from its fields; None: dense.
    sparse_mlp: SparseMlp | None = None
    # The embedding row whose lookups give it no gradient (nn.Embedding's padding_idx), where the family's
    # transformers class builds its embedding with config.pad_token_id; None: no such row.
    pad_token_id: int | None = None

    # --- what a family defines ---------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def example(cls) -> "ModelConfig":
        """A tiny model of this model_type with every variation the family has (biases, norms, scalings, tied
        or not) at sizes that run in a test: what tests/test_families.py holds against transformers."""

    # --- the same for every family ---------------------------------------------------------------------
    def params(self) -> UnitParams:
        """Its parameters by streamed unit: each unit's own, what it borrows and uses on the device, the experts
        expert groups load (`layers.params.UnitParams`)."""
        return self.params_class(self)

    def attention(self) -> AttentionLayout:
        """Its attention by layer: each block's kind, its window and RoPE table, the context
        (`layers.attention.AttentionLayout`)."""
        return self.attention_class(self)

    def costs(self) -> Costs:
        """The family's byte and FLOP inputs for memory_model (`layers.costs.Costs`), read from this config."""
        return self.costs_class(self)

    def lora(self) -> LoraTargets:
        """The block's projections that LoRA may target, their shapes and keys (`layers.targets.LoraTargets`)."""
        return self.lora_class(self)

    def adapter(self) -> StateDictAdapter:
        """How transformers names the family's model: its config.json (`to_hf`), the checkpoint key of each unit's
        tensor (`key`, `prefix`) and how it saves them (`layers.adapter.StateDictAdapter`)."""
        return self.adapter_class(self)

    @property
    def attention_width(self) -> int:
        """The width of all query heads together: q's, and SDPA's output's, features per token."""
        return self.num_attention_heads * self.head_dim

    def num_params(self) -> int:
        params = self.params()
        return params.embed() + self.num_hidden_layers * params.block() + params.head()

    def unit_names(self) -> list[str]:
        """The streamed units in execution order: 'embed', 'block.0' … 'block.{L-1}', 'head'."""
        return ["embed", *(f"block.{i}" for i in range(self.num_hidden_layers)), "head"]

    def describe(self) -> str:
        """One line for traces and reports: the family and its main sizes."""
        return f"{self.model_type} d{self.hidden_size} x {self.num_hidden_layers} layers"

    def to_dict(self) -> dict[str, Any]:
        """Our own fields and the model_type: what a store's manifest records (`ModelConfig.from_dict`)."""
        return {"model_type": self.model_type,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def resized(self, **sizes: int) -> Self:
        """A copy with the given common sizes (hidden_size=..., num_hidden_layers=...) changed and the rest
        kept, validated as any config. A size the family derives rather than stores (GPT-J's head_dim) must come
        out as asked."""
        own = {f.name for f in dataclasses.fields(self)}
        stored: dict[str, int | None] = {self.own_names.get(k, k): v for k, v in sizes.items()
                                         if self.own_names.get(k, k) in own}
        if self.pad_token_id is not None and self.pad_token_id >= sizes.get("vocab_size", self.vocab_size):
            stored["pad_token_id"] = None  # a vocabulary without that row (a calibration probe's) pads nothing
        out = dataclasses.replace(self, **stored)
        derived = {k: (getattr(out, k), v) for k, v in sizes.items() if self.own_names.get(k, k) not in own}
        wrong = {k: got for k, (got, asked) in derived.items() if got != asked}
        if wrong:
            raise ConfigError(f"{self.model_type} derives {', '.join(wrong)}: asked for "
                              f"{', '.join(f'{k}={sizes[k]}' for k in wrong)}, the other sizes give "
                              f"{', '.join(f'{k}={v}' for k, v in wrong.items())}")
        return out

    # --- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Self:
        """Build from our own field names (and model_type; GPT-J where absent, as stores written before other
        families were); an unknown field is an error, not ignored. On a family class, only that family."""
        fields = dict(fields)
        target = _family_of(fields.pop("model_type", getattr(cls, "model_type", "gptj")))
        if cls is not ModelConfig and target is not cls:
            raise ConfigError(f"model_type {target.model_type!r} is not {cls.model_type!r}")
        known = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(str(k) for k in set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; valid fields: {sorted(known)}")
        built = target(**fields)
        assert isinstance(built, cls)  # a family's class builds only its own configs
        return built

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> "ModelConfig":
        """Read a Hugging Face config: a dict, a config.json, or a folder holding one. Its model_type picks the
        family (GPT-J where absent); on a family class, only that family is accepted."""
        raw = dict(source) if isinstance(source, Mapping) else read_hf_json(Path(source))
        target = _family_of(raw.pop("model_type", getattr(cls, "model_type", "gptj")))
        if cls is not ModelConfig and target is not cls:
            raise ConfigError(f"model_type is {target.model_type!r}; expected {cls.model_type!r}")
        adapter = target.adapter_class
        for name in adapter.required:
            own = target.own_names.get(name, name)
            if name not in raw and own not in raw:
                shown = own if own == name else f"{own} ({name})"
                raise ConfigError(f"the {target.model_type} config has no {shown}; add it as transformers writes it")
        return target.from_dict(adapter.config_fields(target, {**adapter.defaults, **raw}))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None

    @classmethod
    def named(cls, model: str | Path) -> "ModelConfig":
        """What a --model names: a preset, else a Hugging Face config.json or a folder holding one."""
        if str(model) in PRESETS:
            return PRESETS[str(model)]
        if not Path(model).exists():
            raise ConfigError(f"{str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                              "config.json or folder holding one")
        return cls.from_hf(model)


def _family_of(model_type: Any) -> type[ModelConfig]:
    found = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise ConfigError(f"model_type is {model_type!r}; supported: {', '.join(repr(t) for t in FAMILIES)}")
    return found


def gguf_note(folder: Path) -> str:
    """'; it holds GGUF files (x.gguf), which are not read: ...' where `folder` holds any, else ''."""
    found = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
    if not found:
        return ""
    return (f"; it holds GGUF files ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), which are not read "
            "yet: pass the Hugging Face folder (config.json and safetensors) the GGUF was made from")


def read_hf_json(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no model config at {path}; pass a config.json or the folder that holds it"
                          f"{gguf_note(path.parent)}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark (Notepad) is no error
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{path} nests its JSON deeper than Python's parser goes; a model config is one flat "
                          "object") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def check_size(cfg: ModelConfig) -> None:
    """Sizes no machine could train are refused in closed form, before anything is built per layer or per expert:
    16 bytes of training state per parameter beyond MAX_STATE_BYTES, more blocks than MAX_LAYERS or more experts
    than MAX_EXPERTS (the runtime and the planner keep records of each)."""
    layers, experts = cfg.num_hidden_layers, cfg.params().experts()
    if layers > MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers {layers:,} is more than {MAX_LAYERS:,} (the deepest published "
                          "decoders have about 128); check the config's sizes")
    if experts > MAX_EXPERTS:
        raise ConfigError(f"{experts:,} experts per block is more than {MAX_EXPERTS:,} (published models "
                          "have at most 384); check the config's sizes")
    state = 16 * max(cfg.num_params(), cfg.max_position_embeddings * cfg.rotary_dim)
    if state > MAX_STATE_BYTES:
        raise ConfigError(f"a model of {cfg.num_params():,} parameters (vocab_size {cfg.vocab_size}, hidden "
                          f"size {cfg.hidden_size}, {layers} layers) needs {state / 2**40:,.0f} TiB of "
                          f"training state (16 B/param), more than any machine holds ({MAX_STATE_BYTES // 2**40} "
                          "TiB); check the config's sizes")


def check_heads(cfg: ModelConfig) -> None:
    """Grouped-query attention's heads and RoPE's pairs: num_attention_heads a multiple of num_key_value_heads,
    head_dim even."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                          f"num_key_value_heads ({cfg.num_key_value_heads})")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim ({cfg.head_dim}) must be even: RoPE rotates pairs of dimensions")


def check_rms_norm_eps(eps: object) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ConfigError(f"rms_norm_eps must be in (0, 1), got {eps!r}")


def check_pad_token_id(cfg: ModelConfig) -> None:
    """`pad_token_id` is a token id below vocab_size, or None."""
    pad = cfg.pad_token_id
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < cfg.vocab_size):
        raise ConfigError(f"pad_token_id must be a token id below vocab_size ({cfg.vocab_size}) or null, got {pad!r}")


def take_aliases(raw: dict[str, Any], aliases: Mapping[str, str]) -> None:
    """Rename HF's alternative key names to the family's own, refusing a contradiction."""
    for alias, name in aliases.items():
        if alias in raw:
            value = raw.pop(alias)
            if name in raw and raw[name] != value:
                raise ConfigError(f"{alias}={value} contradicts {name}={raw[name]}; keep one of them")
            raw[name] = value
