"""Incremental decoding of `HybridModel`: one token per rollout per call, batched over rollouts.

`decode_step(model, cache, tokens_B)` feeds token b to rollout b (a batch row) at its own next
position and returns the next-token logits [B, V] (fp32), using the model's own weights and a
`DecodeCache` that holds, per layer, what the training forward reads from earlier positions:
- KDA layer: the recurrent state S [B, H, K, V] (fp32; fp64 for fp64 weights) advanced by the
  token recurrence of `harts.ops.kda.naive` (S ← diag(exp g)·S; S ← S + β k ⊗ (v − Sᵀk);
  o = Sᵀ(q/√K), q and k L2-normalised), and the short conv's window: the q/k/v projections of the
  last W − 1 positions, most recent first (zeros before the first position, as the training path's
  conv reads a zero row there);
- MLA layer: the latent KV cache, per position the normalised compressed kv [r] and the shared
  rope key [E_r] (rotated at its position when `use_rope`), up to the cache's capacity T; every step
  expands the cached latents to keys and values with kv_b_proj (the cache stays r + E_r numbers
  per position and layer).
Per-row work (norms, projections, gates, dense MLP, MoE routing and experts, LM head) calls the
model's modules (and on CUDA the same gate kernel and the fused conv's fp32 arithmetic) on the B
rows, so it is the training path's function of the same weights.

The Gated DeltaNet family's layers keep their own caches (harts.model.gdn_decode: GDN's state and conv window,
gated GQA's keys and values).

Forking: `cache.select(rows)` returns a cache whose row i is a copy of row `rows[i]`: a row listed
twice forks the rollout (both continuations start from the same state and caches), a row left out
is dropped.

Invariant (tests/model/test_decode.py): feeding a sequence token by token gives the logits of the
full forward of the baseline layout at every position (fp32, max |Δ| ≤ 1e-5), also for two
continuations forked from one prefix, each against its own full forward. Not a training path: no
autograd.
Legend: B rollouts, T cache capacity, D hidden, H heads, K/V KDA head dims, W conv width,
r kv_lora_rank, E_r rope dim, E qk head dim, F v head dim of MLA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harts.model.gdn import GatedAttentionLayer, GDNLayer
from harts.model.gdn_decode import GDNCache, GQACache, gdn_step, gqa_step
from harts.model.layers import KDALayer, MLALayer
from harts.model.model import HybridModel
from harts.ops import uses_fp32_kernels
from harts.ops.kda.compact import l2norm
from harts.ops.kda.naive import compute_dtype
from harts.ops.norm_gate import norm_gate
from harts.runtime.layout import conv_taps


@dataclass(eq=False)
class KDACache:
    state_BHKV: torch.Tensor
    """Recurrent state after the rollout's last position."""
    window_BWC: torch.Tensor
    """[B, W − 1, 3, H·K]: q/k/v projections of the previous W − 1 positions, most recent first."""


@dataclass(eq=False)
class MLACache:
    latent_BTR: torch.Tensor
    """Normalised compressed kv of each cached position (kv_norm's output, kv_b_proj's input)."""
    rope_BTE: torch.Tensor
    """Shared rope key of each cached position ([B, T, 0] for NoPE)."""


@dataclass(eq=False)
class DecodeCache:
    """The decoding state of B rollouts: their lengths and every layer's cache."""

    lengths: torch.Tensor
    """int64 [B]: tokens consumed so far, i.e. the position of the next token."""
    layers: list[KDACache | MLACache | GDNCache | GQACache]
    """One per block of the model, in order."""
    capacity: int
    """T: positions an MLA cache holds; a rollout cannot grow beyond it."""

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def select(self, rows: torch.Tensor) -> DecodeCache:
        """Row i of the result is a copy of row `rows[i]` (repeat a row to fork it, omit it to drop it)."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.lengths.device)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, rows)

        layers = [KDACache(pick(c.state_BHKV), pick(c.window_BWC)) if isinstance(c, KDACache)
                  else MLACache(pick(c.latent_BTR), pick(c.rope_BTE)) if isinstance(c, MLACache)
                  else c.select(rows) for c in self.layers]
        return DecodeCache(lengths=pick(self.lengths), layers=layers, capacity=self.capacity)


def empty_cache(model: HybridModel, batch_size: int, capacity: int) -> DecodeCache:
    """The cache of `batch_size` rollouts that have consumed nothing yet, on the model's device."""
    if capacity < 1 or batch_size < 0:
        raise ValueError(f"empty_cache: need capacity >= 1 and batch_size >= 0, got {capacity}, {batch_size}")
    weight = model.embed.weight
    device, dtype = weight.device, weight.dtype
    state_dtype = compute_dtype(weight)
    layers: list[KDACache | MLACache | GDNCache | GQACache] = []
    for block in model.blocks:
        mixer = block.mixer
        if isinstance(mixer, GDNLayer):
            layers.append(GDNCache.empty(mixer, batch_size, state_dtype))
        elif isinstance(mixer, GatedAttentionLayer):
            layers.append(GQACache.empty(mixer, batch_size, capacity))
        elif isinstance(mixer, KDALayer):
            heads, head_dim = mixer.num_heads, mixer.head_dim
            width = mixer.q_conv.shape[1]
            layers.append(KDACache(
                state_BHKV=torch.zeros(batch_size, heads, head_dim, head_dim, device=device, dtype=state_dtype),
                window_BWC=torch.zeros(batch_size, width - 1, 3, heads * head_dim, device=device, dtype=dtype),
            ))
        else:
            assert isinstance(mixer, MLALayer)
            config = mixer.config
            layers.append(MLACache(
                latent_BTR=torch.zeros(batch_size, capacity, config.kv_lora_rank, device=device, dtype=dtype),
                rope_BTE=torch.zeros(batch_size, capacity, config.qk_rope_head_dim, device=device, dtype=dtype),
            ))
    return DecodeCache(lengths=torch.zeros(batch_size, dtype=torch.int64, device=device), layers=layers,
                       capacity=capacity)


def _kda_step(layer: KDALayer, x_BD: torch.Tensor, cache: KDACache) -> torch.Tensor:
    batch = x_BD.shape[0]
    shape = (batch, layer.num_heads, layer.head_dim)
    projected = torch.stack([layer.q_proj(x_BD), layer.k_proj(x_BD), layer.v_proj(x_BD)], dim=1)
    window = cache.window_BWC
    # On CUDA the training path's conv accumulates in fp32 and rounds once (harts.ops.conv): so here.
    conv_dtype = torch.float32 if uses_fp32_kernels(projected) else projected.dtype
    q, k, v = (
        F.silu(conv_taps(projected[:, i].to(conv_dtype), window[:, :, i].to(conv_dtype), conv))
        .to(projected.dtype).view(shape)
        for i, conv in enumerate((layer.q_conv, layer.k_conv, layer.v_conv))
    )
    if window.shape[1]:
        cache.window_BWC = torch.cat([projected.unsqueeze(1), window[:, :-1]], dim=1)
    g = layer.decay(x_BD)
    beta = torch.sigmoid(layer.b_proj(x_BD).float())

    dtype = cache.state_BHKV.dtype
    q, k = l2norm(q).to(dtype), l2norm(k).to(dtype)
    state = cache.state_BHKV * g.to(dtype).exp().unsqueeze(-1)
    error = v.to(dtype) - (k.unsqueeze(-1) * state).sum(-2)
    state = state + (beta.to(dtype).unsqueeze(-1) * k).unsqueeze(-1) * error.unsqueeze(-2)
    cache.state_BHKV = state
    o = ((q * layer.head_dim**-0.5).unsqueeze(-1) * state).sum(-2).to(v.dtype)

    o = norm_gate(o, layer.g_proj(x_BD).view(shape), layer.o_norm.weight, layer.o_norm.eps)
    return layer.o_proj(o.reshape(batch, -1).to(x_BD.dtype))


def _mla_step(layer: MLALayer, x_BD: torch.Tensor, cache: MLACache, positions_B: torch.Tensor,
              length: int) -> torch.Tensor:
    """`length`: cached positions to attend over (the longest rollout's, this token included)."""
    config = layer.config
    batch, heads = x_BD.shape[0], config.num_heads
    rows = torch.arange(batch, device=x_BD.device)
    q = layer.q_proj(x_BD).view(batch, heads, layer.qk_head_dim)
    compressed, k_rope = layer.kv_a_proj(x_BD).split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
    if config.qk_rope_head_dim and config.use_rope:
        q_nope, q_rope = q.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, layer.rotate(q_rope, positions_B)], dim=-1)
        k_rope = layer.rotate(k_rope.unsqueeze(1), positions_B).squeeze(1)
    cache.latent_BTR[rows, positions_B] = layer.kv_norm(compressed)
    cache.rope_BTE[rows, positions_B] = k_rope

    kv = layer.kv_b_proj(cache.latent_BTR[:, :length]).view(batch, length, heads, -1)
    k_nope, v = kv.split([config.qk_nope_head_dim, config.v_head_dim], dim=-1)
    if config.qk_rope_head_dim:
        k_rope_all = cache.rope_BTE[:, :length].unsqueeze(2).expand(-1, -1, heads, -1)
        k = torch.cat([k_nope, k_rope_all], dim=-1)
    else:
        k = k_nope
    scores = torch.einsum("bhe,bthe->bht", q, k).float() * layer.scale
    visible = torch.arange(length, device=x_BD.device).unsqueeze(0) <= positions_B.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
    o = layer.gate_output(torch.einsum("bht,bthf->bhf", weights.to(v.dtype), v), x_BD)
    return layer.o_proj(o.reshape(batch, heads * config.v_head_dim))


@torch.no_grad()
def decode_step(model: HybridModel, cache: DecodeCache, tokens_B: torch.Tensor) -> torch.Tensor:
    """Feed token b to rollout b at position `cache.lengths[b]`; advance the cache in place (lengths
    + 1); return the next-token logits [B, V] in fp32 (fp64 for fp64 weights)."""
    if tokens_B.shape != (cache.batch_size,):
        raise ValueError(f"decode_step: expected {cache.batch_size} tokens, got shape {tuple(tokens_B.shape)}")
    if cache.batch_size and int(cache.lengths.max()) >= cache.capacity:
        raise ValueError(f"decode_step: a rollout reached the cache capacity of {cache.capacity} positions")
    positions = cache.lengths
    length = int(positions.max()) + 1 if cache.batch_size else 0
    x = model.embed(tokens_B)
    for block, layer_cache in zip(model.blocks, cache.layers, strict=True):
        h = block.mixer_norm(x)
        if isinstance(layer_cache, KDACache):
            x = x + _kda_step(block.mixer, h, layer_cache)
        elif isinstance(layer_cache, GDNCache):
            x = x + gdn_step(block.mixer, h, layer_cache)
        elif isinstance(layer_cache, GQACache):
            x = x + gqa_step(block.mixer, h, layer_cache, positions, length)
        else:
            x = x + _mla_step(block.mixer, h, layer_cache, positions, length)
        h = block.mlp_norm(x)
        x = x + (block.mlp(h)[0] if block.is_moe else block.mlp(h))
    hidden = model.final_norm(x)
    cache.lengths = positions + 1
    # In the weights' dtype, as the training step's LM head (bf16 parameters: a bf16 matmul).
    return (hidden @ model.lm_head.weight.T).to(compute_dtype(hidden))
