"""Configuration of the hybrid KDA/MLA MoE model (configs/models/NAME.yaml).

`ModelConfig` composes one small dataclass per component. Layer i is an MLA layer when
(i + 1) is a multiple of `layers_per_group` (groups of `layers_per_group - 1` KDA layers then one
MLA layer, as in Ling-3 / Kimi Linear), else a KDA layer; an explicit `mla_layers` list replaces
that pattern (Kimi-Linear-48B ends on an extra MLA layer). The first `num_dense_layers` layers use
a dense SwiGLU MLP, the rest the MoE MLP.

`ModelConfig.mtp` (an `MTPConfig`) adds multi-token-prediction layers after the decoder (harts.model.mtp);
None, the default, builds none.

The options whose defaults keep HARTS's own layers and that exist to reproduce Kimi-Linear's
checkpoints exactly (harts.model.hf): `KDAConfig.output_gate_bias`, `MLAConfig.use_rope`,
`MLAConfig.latent_norm_eps` and `ModelConfig.mla_layers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harts.config import load_config, shipped_config_path
from harts.model.moe import MoEConfig


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
    g_b_proj has none)."""

    def __post_init__(self) -> None:
        _check_positive("kda", num_heads=self.num_heads, head_dim=self.head_dim, conv_size=self.conv_size,
                        gate_rank=self.gate_rank, chunk_size=self.chunk_size)


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
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False
    mla_layers: list[int] | None = None
    """0-based indices of the MLA layers, strictly increasing; replaces the layers_per_group pattern
    (None: the pattern)."""
    mtp: MTPConfig | None = None
    """Multi-token-prediction layers after the decoder (None: none)."""

    def __post_init__(self) -> None:
        _check_positive("model", vocab_size=self.vocab_size, hidden_size=self.hidden_size)
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

    def layer_kind(self, index: int) -> str:
        if self.mla_layers is not None:
            return "mla" if index in self.mla_layers else "kda"
        return "mla" if (index + 1) % self.layers_per_group == 0 else "kda"

    def layer_kinds(self) -> list[str]:
        return [self.layer_kind(i) for i in range(self.num_layers)]


def load_model_config(name_or_path: str) -> ModelConfig:
    """A shipped config by name (`tiny`, `cpu-small`, `h200`, `ling3-tiny`) or a YAML path."""
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
