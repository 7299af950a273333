"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) over a paged KV cache.

Every token of a step sits in one flat [num_tokens, hidden] batch; requests are told apart only by
the attention metadata, so a ragged mix of prefill chunks, decodes and verifications costs no
padding. Q/K/V and gate/up projections are fused so that each layer streams its weights in as few
matrix products as possible (a batch-1 step on a CPU is bound by reading weights)."""

from __future__ import annotations

import torch
from torch import nn

from faser.layers.attention import AttentionMetadata, PagedAttention
from faser.layers.norm import FEATURE_EPS, RMSNorm, add_rms_scale
from faser.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from faser_kernels import cpu_decoder, cpu_ops
from faser_kernels.backend import attention_backend
from faser_kernels.cpu_linear import PackedWeight

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
RESCORED = 8  # leading candidates a row's bf16 head logits are recomputed for in float32


class LlamaAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2")
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n, heads = hidden.shape[0], self.num_heads
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : self.q_size + self.kv_size].view(n, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = apply_rotary(qk, rope)  # queries and keys rotated in one pass, in place
        out = self.attn(qk[:, :heads], qk[:, heads:], v, kv_cache, meta)
        return self.o_proj(out.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)
        act = cpu_ops.silu_mul(gate_up) if cpu_ops.runs_on(gate_up) else \
            cpu_ops.silu_mul_torch(gate_up)
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the last layer's output
        residual: torch.Tensor | None,  # [num_tokens, hidden] fp32: the stream; None first
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output, the stream before it
        """The residual stream is hidden + residual, added inside the norm that reads it."""
        normed, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(rope, normed, kv_cache, meta)
        normed, residual = self.post_attention_layernorm.add_norm(hidden, residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)
        )
        self.rotary = RotaryEmbedding(cfg, max_position)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # a draft may predict only the target's most frequent tokens while reading all of them
        output_vocab_size = getattr(cfg, "faser_output_vocab_size", None) or cfg.vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, output_vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.head_float32: torch.Tensor | None = None  # [out vocab, hidden]: keep_float32_head
        self.fused_layers: cpu_decoder.DecoderLayers | None = None  # set by fuse_layers

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] float32, after the final norm
        return self.forward_features(input_ids, positions, kv_caches, meta, ())[0]

    def forward_features(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        feature_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden state and, for a feature draft, the residual stream after each layer
        in `feature_layers` (Hugging Face's hidden_states numbering: i is after layer i, and
        num_layers is the final, normed output), RMS-scaled and concatenated:
        [num_tokens, len(feature_layers) * hidden]; None when no layer is asked for."""
        return self.run_layers(self.embed_tokens(input_ids), positions, kv_caches, meta,
                               feature_layers)

    def fuse_layers(self) -> str | None:
        """From now on, run the layers in one C call per forward (faser_kernels.cpu_decoder)
        where they allow it; else returns why not, and they run one by one."""
        reason = _unfusable(self)
        if reason is not None or self.fused_layers is not None:
            return reason
        layers = [(layer.self_attn, layer.mlp) for layer in self.layers]
        projections = {"qkv": [attn.qkv_proj for attn, _ in layers],
                       "o": [attn.o_proj for attn, _ in layers],
                       "gate_up": [mlp.gate_up_proj for _, mlp in layers],
                       "down": [mlp.down_proj for _, mlp in layers]}
        weights = {
            "input_norm": [layer.input_layernorm.weight for layer in self.layers],
            "qkv_bias": [attn.qkv_proj.bias for attn, _ in layers],
            "post_norm": [layer.post_attention_layernorm.weight for layer in self.layers],
            **{name: [p.packed.data for p in ps] for name, ps in projections.items()},
            **{f"{name}_scale": [p.packed.scale for p in ps] for name, ps in projections.items()},
        }
        blocks = {name: [p.packed.blocks for p in ps] for name, ps in projections.items()}
        attn, cfg = self.layers[0].self_attn, self.config
        shapes = cpu_decoder.LayerShapes(cfg.hidden_size, attn.num_heads, attn.num_kv_heads,
                                         attn.head_dim, self.layers[0].mlp.intermediate_size,
                                         self.layers[0].input_layernorm.eps)
        self.fused_layers = cpu_decoder.DecoderLayers(shapes, weights, self.norm.weight,
                                                      self.embed_tokens.weight.dtype, blocks)
        return None

    def run_layers(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the input embeddings
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rope = self.rotary(positions)
        if self.fused_layers is not None and cpu_ops.runs_on(hidden):
            return self._run_fused(hidden, rope, kv_caches, meta, feature_layers)
        taken: dict[int, torch.Tensor] = {}
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
            if i + 1 in feature_layers and i + 1 < len(self.layers):
                taken[i + 1] = add_rms_scale(hidden, residual)
        out, _ = self.norm.add_norm(hidden, residual, torch.float32)
        if not feature_layers:
            return out, None
        taken[len(self.layers)] = out.to(hidden.dtype)
        return out, torch.cat([taken[i] for i in feature_layers], dim=-1)

    def _run_fused(
        self, hidden: torch.Tensor, rope: Rope, kv_caches: KVCaches, meta: AttentionMetadata,
        feature_layers: tuple[int, ...], prologue: cpu_decoder.Prologue | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """run_layers in one C call, which also takes the inner feature layers' rows; with a
        prologue, `hidden` is only the buffer the call builds the input in."""
        num_layers = len(self.layers)
        taps = sorted({i for i in feature_layers if 0 < i < num_layers})
        x = hidden if prologue else hidden.clone(memory_format=torch.contiguous_format)
        out, rows = self.fused_layers.run(
            x, rope.positions.contiguous(), meta.slot_mapping.contiguous(), meta.block_tables,
            meta.seq_lens, meta.cu_seqlens_q, rope.cos, rope.sin, kv_caches, taps, FEATURE_EPS,
            prologue,
        )
        if not feature_layers:
            return out, None
        taken = {**dict(zip(taps, rows, strict=True)), num_layers: out.to(hidden.dtype)}
        return out, torch.cat([taken[i] for i in feature_layers], dim=-1)

    def keep_float32_head(self, weight: torch.Tensor) -> None:  # [out vocab, hidden] float32
        """Rescore the head's leading candidates in float32 (see compute_logits): for a target in
        bf16, whose bf16 head flips near-tied argmaxes that float32 would not."""
        self.head_float32 = weight

    def compute_logits(
        self, hidden: torch.Tensor  # [n, hidden] float32, the final norm's output
    ) -> torch.Tensor:  # [n, out vocab] float32
        """The head in the model's dtype; with keep_float32_head, its RESCORED leading logits of
        each row are recomputed in float32, each from that row alone (row-invariant), so the
        argmax and the likeliest tokens are float32's at a few dot products a row."""
        logits = self.lm_head(hidden.to(self.embed_tokens.weight.dtype))
        if self.head_float32 is None:
            return logits.float()
        fused = logits.dtype == torch.bfloat16 and cpu_ops.runs_on(logits)
        rescore = cpu_ops.rescore_head if fused else cpu_ops.rescore_head_torch
        return rescore(logits, hidden, self.head_float32, RESCORED)


def _unfusable(model: LlamaForCausalLM) -> str | None:
    """Why the model's layers cannot run as one C call; None when they can."""
    dtype = model.embed_tokens.weight.dtype
    if model.embed_tokens.weight.device.type != "cpu" or not cpu_ops.runs_on(
        model.embed_tokens.weight
    ):
        return "the fused CPU kernels do not run here"
    if (reason := cpu_decoder.unavailable_reason(dtype)) is not None:
        return reason
    attn = model.layers[0].self_attn
    group = attn.num_heads // attn.num_kv_heads
    if attention_backend(torch.device("cpu"), dtype, attn.head_dim, group) != "cpu":
        return "the CPU attention kernel does not take these heads"
    for layer in model.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        if not all(isinstance(getattr(m, "packed", None), PackedWeight) for m in linears):
            return "the linear layers are not packed for the CPU kernel"
        if any(getattr(m, "bias", None) is not None for m in linears[1:]):
            return "a bias outside the qkv projection"
        if layer.self_attn.qk_norm:
            return "per-head q/k norms"
    return None
