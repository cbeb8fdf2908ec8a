"""Configuration of the hybrid linear-attention/attention MoE model (configs/models/NAME.yaml).

`ModelConfig` composes one small dataclass per component. Layer i is a full-attention layer when
(i + 1) is a multiple of `layers_per_group` (groups of `layers_per_group - 1` linear-attention layers then one
attention layer, as in Ling-3 / Kimi Linear / Qwen3-Next), else a linear-attention layer; an explicit
`mla_layers` list replaces that pattern (Kimi-Linear-48B ends on an extra MLA layer). The first
`num_dense_layers` layers use a dense SwiGLU MLP, the rest the MoE MLP.

Two families: KDA + MLA (the `kda` and `mla` sections: Ling-3, Kimi-Linear) and Gated DeltaNet + gated GQA
(the `gdn` and `gated_attention` sections, with `norm_zero_centered`: Qwen3-Next, Qwen3.5), one linear-attention
section and one attention section per model; the layer kinds are "kda"/"gdn" and "mla"/"gqa".

`ModelConfig.mtp` (an `MTPConfig`) adds multi-token-prediction layers after the decoder (harts.model.mtp);
None, the default, builds none.

The options whose defaults keep HARTS's own layers and that exist to reproduce Kimi-Linear's
checkpoints exactly (harts.model.hf): `KDAConfig.output_gate_bias`, `MLAConfig.use_rope`,
`MLAConfig.latent_norm_eps` and `ModelConfig.mla_layers`; BailingHybrid's (Ling-3's) likewise:
`KDAConfig.full_rank_gates` and `gate_lower_bound`, `MLAConfig.rope_interleave`, `output_gate` and
`attention_bias`, `MoEConfig.num_groups` and `topk_groups` (group-limited routing), and the per-layer
SwiGLU limits `ModelConfig.expert_swiglu_limits` / `shared_expert_swiglu_limits`; those that reproduce
Qwen3-Next's / Qwen3.5's (harts.model.hf.qwen3_next): the `gdn` and `gated_attention` sections,
`ModelConfig.norm_zero_centered` and `MoEConfig.shared_expert_gate`. `ModelConfig.hf_layout` names the Hugging
Face layout a model is saved in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harts.config import load_config, shipped_config_path
from harts.model.moe import MoEConfig


HF_LAYOUTS = ("kimi_linear", "bailing_hybrid", "qwen3_next", "qwen3_5_moe_text")
"""The Hugging Face layouts a model config may name (`ModelConfig.hf_layout`; harts.model.hf.ARCHITECTURES)."""

GDN_HF_LAYOUTS = ("qwen3_next", "qwen3_5_moe_text")
"""The layouts of the Gated DeltaNet family (GDN / gated GQA); the others are the KDA/MLA family's. The first of
each family's is its default."""


def _check_positive(owner: str, **values) -> None:
    """ValueError naming the first of `values` that is not a positive integer."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _check_epsilon(owner: str, name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and 0 < value < 1):
        raise ValueError(f"{owner}.{name} must be a finite number in (0, 1), got {value!r}")


@dataclass(kw_only=True)
class KDAConfig:
    """Kimi Delta Attention layer."""

    num_heads: int
    head_dim: int
    """K = V, the key and value head dimension."""
    conv_size: int = 4
    """Width of the short causal convolution on q, k and v."""
    gate_rank: int | None = None
    """Rank of the low-rank decay-gate and output-gate projections (default: head_dim)."""
    chunk_size: int = 64
    """B: the chunked kernel's chunk length (chunks aligned at multiples of B)."""
    output_gate_bias: bool = True
    """A bias on the output gate's full-rank projection (fla's KDA layer has one; Kimi-Linear's
    g_b_proj and BailingHybrid's g_proj have none)."""
    full_rank_gates: bool = False
    """The decay gate's input f and the output gate g as one full-rank projection each, D -> H·K
    (BailingHybrid's f_proj and g_proj, `no_kda_lora`), instead of a rank-`gate_rank` pair."""
    gate_lower_bound: float | None = None
    """The bounded ("safe") decay gate g = gate_lower_bound · sigmoid(exp(A_log)·(f + dt_bias)), in
    (gate_lower_bound, 0), instead of -exp(A_log)·softplus(f + dt_bias) (BailingHybrid's kda_safe_gate
    with kda_lower_bound; fla's `lower_bound`). None: the softplus gate."""

    def __post_init__(self) -> None:
        _check_positive("kda", num_heads=self.num_heads, head_dim=self.head_dim, conv_size=self.conv_size,
                        gate_rank=self.gate_rank, chunk_size=self.chunk_size)
        if self.full_rank_gates and self.gate_rank is not None:
            raise ValueError(f"kda.gate_rank ({self.gate_rank}) has no meaning with kda.full_rank_gates")
        bound = self.gate_lower_bound
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                  or not (math.isfinite(bound) and bound < 0)):
            raise ValueError(f"kda.gate_lower_bound must be a finite number < 0, got {bound!r}")


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention layer (DeepSeek-V2 style)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    """Dimension of the decoupled RoPE part; 0 = NoPE (no positional encoding)."""
    v_head_dim: int
    q_lora_rank: int | None = None
    """Low-rank query compression (None = a full query projection)."""
    rope_theta: float = 10000.0
    use_rope: bool = True
    """Rotate the decoupled qk_rope_head_dim part of the query and of the shared key. False keeps
    that part unrotated (Kimi-Linear's NoPE MLA, `mla_use_nope`): positionless attention with
    qk head dim qk_nope_head_dim + qk_rope_head_dim."""
    latent_norm_eps: float | None = None
    """Epsilon of the RMSNorms of the compressed KV and of the low-rank query (None: the model's
    norm_eps). Kimi-Linear and DeepSeek use 1e-6 there whatever their rms_norm_eps."""
    rope_interleave: bool = False
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... of the decoupled part, written back as [evens | odds]
    (DeepSeek's and BailingHybrid's `rope_interleave`), instead of the halves (x_i, x_{i + E/2}): the half-split
    rotation of x[0::2] ‖ x[1::2]."""
    output_gate: bool = False
    """A per-head sigmoid gate on the attention output, o_h ← o_h · sigmoid(x·g_h) with g_proj [H, D] and no
    bias (BailingHybrid's gated MLA, `gated_attention_proj_granularity_type: head_wise`)."""
    attention_bias: bool = False
    """Biases on the low-rank query's first projection, on kv_a_proj and on o_proj (BailingHybrid's
    `attention_bias`; the full-rank query projection and kv_b_proj have none either way)."""

    def __post_init__(self) -> None:
        _check_positive("mla", num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                        qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim,
                        q_lora_rank=self.q_lora_rank)
        if isinstance(self.qk_rope_head_dim, bool) or not isinstance(self.qk_rope_head_dim, int) or (
                self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2):
            raise ValueError(f"mla.qk_rope_head_dim must be an even integer >= 0, got {self.qk_rope_head_dim!r}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"mla.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        _check_epsilon("mla", "latent_norm_eps", self.latent_norm_eps)


MTP_LAYER_KINDS = ("mla", "kda")
"""The token mixers an MTP layer's block may use (Ling-3.0's is full attention: MLA)."""


@dataclass(kw_only=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3 / Megatron style; harts.model.mtp): depth k = 1 .. num_layers predicts
    the token k + 1 ahead with one more block over the previous depth's hidden states and the embeddings."""

    num_layers: int
    """D, the MTP depths (Ling-3.0 and DeepSeek-V3: 1)."""
    loss_scaling_factor: float = 0.1
    """The MTP loss is this factor times the mean over depths of each depth's cross entropy (megatron-core's
    mtp_loss_scaling_factor, whose default this is)."""
    layer_kind: str = "mla"
    """The token mixer of each MTP block (`MTP_LAYER_KINDS`); its MLP is the MoE MLP."""

    def __post_init__(self) -> None:
        _check_positive("mtp", num_layers=self.num_layers)
        if not (math.isfinite(self.loss_scaling_factor) and self.loss_scaling_factor >= 0):
            raise ValueError(f"mtp.loss_scaling_factor must be a finite number >= 0, got {self.loss_scaling_factor!r}")
        if self.layer_kind not in MTP_LAYER_KINDS:
            raise ValueError(f"mtp.layer_kind must be one of {MTP_LAYER_KINDS}, got {self.layer_kind!r}")


@dataclass(kw_only=True)
class GDNConfig:
    """Gated DeltaNet layer (Qwen3-Next / Qwen3.5's linear attention): a per-head scalar decay, grouped values."""

    num_key_heads: int
    """H: query/key heads."""
    num_value_heads: int
    """HV: value heads, a multiple of H (value head j reads query/key head j // (HV / H))."""
    key_head_dim: int
    """K."""
    value_head_dim: int
    """V."""
    conv_size: int = 4
    """Width of the short causal convolution over the concatenated q, k and v channels."""
    chunk_size: int = 64
    """B: the chunked kernel's chunk length (chunks aligned at multiples of B)."""

    def __post_init__(self) -> None:
        _check_positive("gdn", num_key_heads=self.num_key_heads, num_value_heads=self.num_value_heads,
                        key_head_dim=self.key_head_dim, value_head_dim=self.value_head_dim,
                        conv_size=self.conv_size, chunk_size=self.chunk_size)
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"gdn.num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                             f"({self.num_key_heads})")


@dataclass(kw_only=True)
class GatedAttentionConfig:
    """Qwen3-Next / Qwen3.5's full attention: grouped-query attention with a sigmoid output gate (the query
    projection doubled for it), q/k RMSNorm per head and rotary embedding on the first `rotary_dim` dimensions."""

    num_heads: int
    num_kv_heads: int
    """Key/value heads, dividing num_heads."""
    head_dim: int
    rotary_dim: int
    """Rotated dimensions of each query/key head (head_dim · partial_rotary_factor), even; 0 = NoPE."""
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        _check_positive("gated_attention", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"gated_attention.num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads})")
        rotary = self.rotary_dim
        if isinstance(rotary, bool) or not isinstance(rotary, int) or not 0 <= rotary <= self.head_dim or rotary % 2:
            raise ValueError(f"gated_attention.rotary_dim must be an even integer in [0, head_dim = {self.head_dim}], "
                             f"got {rotary!r}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"gated_attention.rope_theta must be a finite number > 1, got {self.rope_theta!r}")


@dataclass(kw_only=True)
class ModelConfig:
    """The whole model."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layers_per_group: int = 4
    """3 KDA + 1 MLA per group by default."""
    num_dense_layers: int = 0
    dense_hidden_size: int = 0
    """Intermediate size of the dense SwiGLU MLP of the first num_dense_layers layers."""
    kda: KDAConfig | None = None
    """The linear-attention layers are KDA layers (exactly one of `kda` and `gdn`)."""
    mla: MLAConfig | None = None
    """The attention layers are MLA layers (exactly one of `mla` and `gated_attention`)."""
    gdn: GDNConfig | None = None
    """The linear-attention layers are Gated DeltaNet layers."""
    gated_attention: GatedAttentionConfig | None = None
    """The attention layers are gated GQA layers."""
    moe: MoEConfig
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False
    mla_layers: list[int] | None = None
    """0-based indices of the attention (MLA or gated GQA) layers, strictly increasing; replaces the
    layers_per_group pattern (None: the pattern)."""
    norm_zero_centered: bool = False
    """The block, final and q/k RMSNorms scale by (1 + w) with w initialised to 0 (Qwen3-Next / Qwen3.5's
    convention) instead of by w initialised to 1."""
    expert_swiglu_limits: list[float] | None = None
    """Per layer (num_layers entries), the routed experts' SwiGLU clipping limit L of that layer's MoE (0: none;
    the dense layers' entries are unused): min(silu(gate), L) ⊙ clamp(up, −L, L) (BailingHybrid's
    `expert_swiglu_limit_list`). None: no clipping anywhere."""
    shared_expert_swiglu_limits: list[float] | None = None
    """The same for the shared expert (BailingHybrid's `share_expert_swiglu_limit_list`)."""
    hf_layout: str | None = None
    """The Hugging Face layout (config.json's model_type, harts.model.hf.ARCHITECTURES) the model is saved in
    and loaded from, one of its family's: "kimi_linear" (Kimi-Linear) or "bailing_hybrid" (BailingHybrid, Ling-3)
    for KDA/MLA, "qwen3_next" (Qwen3-Next) or "qwen3_5_moe_text" (Qwen3.5-MoE's text model) for GDN / gated GQA.
    None resolves to the family's first. Loading a checkpoint sets it; a layout refuses the features it cannot
    express (`harts.model.hf.check_exportable`)."""
    mtp: MTPConfig | None = None
    """Multi-token-prediction layers after the decoder (None: none)."""

    def __post_init__(self) -> None:
        _check_positive("model", vocab_size=self.vocab_size, hidden_size=self.hidden_size)
        if (self.kda is None) == (self.gdn is None):
            raise ValueError("model: give exactly one linear-attention section, kda or gdn")
        if (self.mla is None) == (self.gated_attention is None):
            raise ValueError("model: give exactly one attention section, mla or gated_attention")
        if self.hf_layout is not None and self.hf_layout not in HF_LAYOUTS:
            raise ValueError(f"model.hf_layout must be one of {', '.join(HF_LAYOUTS)}, got {self.hf_layout!r}")
        gdn_family = self.gdn is not None or self.gated_attention is not None
        family_layouts = GDN_HF_LAYOUTS if gdn_family else tuple(x for x in HF_LAYOUTS if x not in GDN_HF_LAYOUTS)
        if self.hf_layout is None:
            self.hf_layout = family_layouts[0]
        elif self.hf_layout not in family_layouts:
            raise ValueError(f"model.hf_layout {self.hf_layout!r} is not a layout of this model's family "
                             f"({' or '.join(family_layouts)})")
        _check_epsilon("model", "norm_eps", self.norm_eps)
        if not (math.isfinite(self.init_std) and self.init_std > 0):
            raise ValueError(f"model.init_std must be a finite number > 0, got {self.init_std!r}")
        if self.num_layers < 1 or self.layers_per_group < 1:
            raise ValueError("num_layers and layers_per_group must be >= 1")
        if self.mla_layers is not None:
            inside = all(0 <= i < self.num_layers for i in self.mla_layers)
            if not inside or any(a >= b for a, b in zip(self.mla_layers, self.mla_layers[1:])):
                raise ValueError(
                    f"mla_layers must rise strictly inside [0, {self.num_layers}), got {self.mla_layers}"
                )
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"moe.hidden_size ({self.moe.hidden_size}) must equal hidden_size ({self.hidden_size})")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError("num_dense_layers must be in [0, num_layers]")
        if self.num_dense_layers and self.dense_hidden_size < 1:
            raise ValueError("dense_hidden_size must be >= 1 when num_dense_layers > 0")
        for name in ("expert_swiglu_limits", "shared_expert_swiglu_limits"):
            limits = getattr(self, name)
            if limits is not None and (len(limits) != self.num_layers or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                    for v in limits)):
                raise ValueError(f"model.{name} must list {self.num_layers} finite numbers >= 0 (0: no clipping), "
                                 f"got {limits!r}")
        if self.mtp is not None and getattr(self, self.mtp.layer_kind) is None:
            # The MTP blocks are built from the model's own kda/mla sections (harts.model.mtp).
            raise ValueError(f"model.mtp.layer_kind {self.mtp.layer_kind!r} needs the model's "
                             f"{self.mtp.layer_kind} section")

    @property
    def linear_kind(self) -> str:
        """The linear-attention layers' kind: "kda" or "gdn"."""
        return "kda" if self.kda is not None else "gdn"

    @property
    def attention_kind(self) -> str:
        """The attention layers' kind: "mla" or "gqa" (gated GQA)."""
        return "mla" if self.mla is not None else "gqa"

    @property
    def linear_attention(self) -> KDAConfig | GDNConfig:
        """The linear-attention section, whose conv_size and chunk_size the row layouts take."""
        return self.kda if self.kda is not None else self.gdn

    def layer_kind(self, index: int) -> str:
        if self.mla_layers is not None:
            attention = index in self.mla_layers
        else:
            attention = (index + 1) % self.layers_per_group == 0
        return self.attention_kind if attention else self.linear_kind

    def layer_kinds(self) -> list[str]:
        return [self.layer_kind(i) for i in range(self.num_layers)]

    def moe_for_layer(self, index: int) -> MoEConfig:
        """The MoE config of layer `index`: `moe` with that layer's SwiGLU limits (itself without limits). The MTP
        layers' blocks (index num_layers + i) have none: the lists hold the decoder's layers (Ling's configs too;
        SGLang's NextN reads entry 0, which the published configs leave at 0)."""
        if (self.expert_swiglu_limits is None and self.shared_expert_swiglu_limits is None) or index >= self.num_layers:
            return self.moe

        def limit(limits: list[float] | None) -> float | None:
            return float(limits[index]) if limits is not None and limits[index] else None

        return replace(self.moe, swiglu_limit=limit(self.expert_swiglu_limits),
                       shared_swiglu_limit=limit(self.shared_expert_swiglu_limits))


def load_model_config(name_or_path: str) -> ModelConfig:
    """A shipped config by name (`tiny`, `cpu-small`, `h200`, `ling3-tiny`, ...: configs/models) or a YAML path."""
    return load_config(shipped_config_path(name_or_path, "models"), ModelConfig)


def load_model_config_with(name_or_path: str, experts_backend: str | None = None) -> ModelConfig:
    """`load_model_config`, with the MoE experts backend replaced when one is given (`with_experts_backend`)."""
    return with_experts_backend(load_model_config(name_or_path), experts_backend)


def with_experts_backend(config: ModelConfig, experts_backend: str | None) -> ModelConfig:
    """`config` with the MoE experts backend replaced when one is given (an execution config's experts_backend:
    the backends hold the same parameters)."""
    if experts_backend is None:
        return config
    return replace(config, moe=replace(config.moe, experts_backend=experts_backend))
