"""gpt-oss's units: Llama's embedding, head and resident model; a block of either layer type whose attention has
q/k/v/o biases and a sink per head, and whose MLP is a mixture of clamped-SwiGLU experts with biases
(layers/moe's `Experts` and `GroupedLinear`, over transformers' transposed tensors). Its state_dict is
transformers' GptOssForCausalLM's, key for key."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layers.block import KVCache, attend
from layers.gpt_oss.config import GptOssConfig
from layers.llama.units import Llama, LlamaEmbedding, LlamaHead
from layers.model import FamilyUnits
from layers.moe.units import Experts, GroupedLinear, sparse_mlp
from layers.olmo2.units import Olmo2RMSNorm
from layers.rotary import apply_rotary_halves, sequence_sincos


class GptOssAttention(nn.Module):
    """Grouped-query attention with biases, rotate-half YaRN RoPE and a learned sink logit per head, over a
    sliding window on sliding layers."""

    def __init__(self, cfg: GptOssConfig, layer_type: str) -> None:
        super().__init__()
        self.cfg, self.window = cfg, cfg.attention().window(layer_type)
        d, q, kv = cfg.hidden_size, cfg.attention_width, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, d, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))

    def init_parameters(self, std: float) -> None:
        nn.init.normal_(self.sinks, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        sin, cos = sequence_sincos(cfg.max_position_embeddings, cfg.rotary_dim, start_pos, T, x.dtype, x.device,
                                   positions, cfg.rope_parameters)
        q, k = apply_rotary_halves(q, sin, cos), apply_rotary_halves(k, sin, cos)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), start_pos, cache, positions,
                     self.window, sinks=self.sinks)
        return self.o_proj(out)


class GptOssExperts(Experts):
    """E clamped-SwiGLU experts with biases, held as transformers holds them, input dimension first:
    gate_up_proj (E, d, 2f), its gate the even columns and up the odd, and down_proj (E, f, d)."""

    def __init__(self, cfg: GptOssConfig) -> None:
        nn.Module.__init__(self)
        e, d, f = sparse_mlp(cfg).num_experts, cfg.hidden_size, sparse_mlp(cfg).width
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.empty(e, d))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.source = None  # its experts load whole (GptOssConfig.experts)
        self.num_experts = e

    def init_parameters(self, std: float) -> None:
        for weight in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(weight, mean=0.0, std=std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            nn.init.zeros_(bias)

    def project(self, x: torch.Tensor, name: str, sizes: list[int] | None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        """Rows grouped by expert, through their expert's `name` weight and bias. Its experts load whole and take no
        adapters (GptOssConfig: no groups, no LoRA on them), so `weight` is always the module's."""
        bias = getattr(self, f"{name}_bias")
        # Each row's expert, in the rows' order; on meta, which holds no routing, its size alone.
        expert = (x.new_zeros(x.shape[0], dtype=torch.long) if sizes is None else
                  torch.repeat_interleave(torch.arange(len(sizes), device=x.device),
                                          torch.tensor(sizes, device=x.device), output_size=x.shape[0]))
        # GroupedLinear takes (E, out, in): the transpose is a view, and so is its gradient's.
        return GroupedLinear.apply(x, getattr(self, name).transpose(1, 2), sizes) + bias[expert]

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssRouter(nn.Linear):
    """A linear map to one logit per expert, with a bias; both drawn at initialisation, as transformers draws
    them."""

    def init_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        nn.init.normal_(self.bias, mean=0.0, std=std)


class GptOssMoe(nn.Module):
    """The router (a linear map with a bias) takes each token's top-k logits; their softmax, over the k alone,
    weights the chosen experts' outputs."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.top_k = sparse_mlp(cfg).num_experts_per_tok
        self.router = GptOssRouter(cfg.hidden_size, sparse_mlp(cfg).num_experts)
        self.experts = GptOssExperts(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])  # (N, d)
        logits, chosen = self.router(x).topk(self.top_k, dim=-1)  # (N, k)
        return self.experts(x, chosen, F.softmax(logits, dim=-1)).view_as(h)


class GptOssBlock(nn.Module):
    """Pre-norm residual: h = h + attn(norm(h)); h = h + moe(norm(h)); the norms' weights multiplied in fp32."""

    def __init__(self, cfg: GptOssConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.input_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer_type)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoe(cfg)

    def forward(self, h: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), start_pos, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssHead(LlamaHead):
    """Llama's head with the final norm's weight multiplied in fp32."""

    norm_type = Olmo2RMSNorm


UNITS = FamilyUnits(embed=LlamaEmbedding, block=GptOssBlock, head=GptOssHead, model=Llama)
