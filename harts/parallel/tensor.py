"""Tensor and sequence parallelism of the hybrid model's layers, applied from outside.

`shard_*` functions cut a plain layer's parameters in place to this rank's part (recording a
`ShardSpec` per cut parameter, so full gradients can be reassembled) and return the names of
the parameters they left whole but whose gradient on a rank is only a part of the full one
(they must be summed over the TP group). `install_region_hooks` brackets a sharded layer with
the collectives of a tensor-parallel region, so the layer's own forward runs unchanged:
- without SP, rows are replicated: entry `copy_to_group` (backward all-reduce), exit
  `reduce_from_group` (forward all-reduce of the row-parallel output projection's partial sums);
- with SP, a rank holds P = ⌈R/tp⌉ rows (the last shards padded with zero rows): entry
  all-gathers the shards (and, for KDA/MLA, trims to the R rows of the layout, which must see
  whole paths), exit pads back and reduce-scatters.

Splits (heads h of this rank, channels of those heads, or a column range c of an MLP):
- KDA: q/k/v projections and their conv weights, the second linear of the decay gate f and of
  the output gate g (with its bias; with `full_rank_gates` their only linear), b_proj, A_log, dt_bias by
  heads; o_proj by input columns. The first (low-rank) linears of f and g and the per-head-dim o_norm stay
  whole (partial).
  The layout and its KDA call schedule are per row, so every rank runs the same schedule on
  its heads.
- MLA: the query projection's last linear, kv_b_proj and the output gate's g_proj (one row a head) by
  heads, o_proj by input columns; kv_a_proj, kv_norm and the low-rank query's first linear and norm (and
  their biases, with `attention_bias`) stay whole (partial). o_proj's bias would be added on every rank:
  an MLA layer with `attention_bias` is refused under TP.
- SwiGLU (dense MLP, shared expert, routed experts with ep = 1): gate and up columns c (the
  stacked [gate; up] is cut at both halves), down by rows c.
- Routed experts with ep > 1: whole experts, E/ep per rank (harts.parallel.expert).
The embedding, norms, router and LM head stay whole. Without SP they compute the same values
and gradients on every TP rank; with SP the norms (and the router) see a shard of the rows, so
their gradients are partial too (`SEQUENCE_PARALLEL_PARTIAL` suffixes).

Reference (tests/parallel/test_tensor.py): for every layer, the sum over ranks of the sharded
layers' outputs equals the unsharded output, their parameter gradients are the slices of the
full gradients (partial ones sum to it), and the specs reassemble every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from harts.model.layers import KDALayer, MLALayer, SwiGLU
from harts.parallel.comm import (
    copy_to_group,
    gather_rows,
    group_size,
    pad_rows,
    padded_rows,
    reduce_from_group,
    reduce_scatter_rows,
)

SEQUENCE_PARALLEL_PARTIAL = ("mixer_norm.weight", "mlp_norm.weight", "final_norm.weight")
"""Whole parameters applied to a rank's row shard under SP (besides the MoE's, see expert.py)."""


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """This rank holds full.index_select(dim, index) of a parameter of shape full_shape."""

    dim: int
    index: torch.Tensor
    full_shape: tuple[int, ...]


def head_index(num_heads: int, width: int, rank: int, size: int) -> torch.Tensor:
    """Channels (head-major, `width` per head) of this rank's contiguous block of heads."""
    per_rank = num_heads // size
    heads = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    return (heads[:, None] * width + torch.arange(width)).reshape(-1)


def halves_index(half: int, rank: int, size: int) -> torch.Tensor:
    """Columns of this rank in a stacked [gate; up] dimension of 2·half (both halves cut alike)."""
    columns = head_index(half, 1, rank, size)
    return torch.cat([columns, columns + half])


class Sharder:
    """Cuts parameters of `model` in place, remembering each one's full name and ShardSpec."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.specs: dict[str, ShardSpec] = {}

    def name(self, parameter: nn.Parameter) -> str:
        return self.names[id(parameter)]

    def cut(self, module: nn.Module, attribute: str, dim: int, index: torch.Tensor) -> None:
        full = getattr(module, attribute)
        name = self.names[id(full)]
        part = nn.Parameter(full.detach().index_select(dim, index.to(full.device)).clone(),
                            requires_grad=full.requires_grad)
        setattr(module, attribute, part)
        self.specs[name] = ShardSpec(dim=dim, index=index.cpu(), full_shape=tuple(full.shape))


def _set_linear_sizes(linear: nn.Linear) -> None:
    linear.out_features, linear.in_features = linear.weight.shape


def _last(projection: nn.Module) -> nn.Linear:
    """The linear that writes a KDA gate's H·K channels: the second of a low-rank pair, or the full-rank one."""
    return projection[-1] if isinstance(projection, nn.Sequential) else projection


def shard_kda(sharder: Sharder, layer: KDALayer, rank: int, size: int) -> list[str]:
    heads = head_index(layer.num_heads, 1, rank, size)
    channels = head_index(layer.num_heads, layer.head_dim, rank, size)
    f_out, g_out = _last(layer.f_proj), _last(layer.g_proj)
    for linear in (layer.q_proj, layer.k_proj, layer.v_proj, f_out, g_out):
        sharder.cut(linear, "weight", 0, channels)
        _set_linear_sizes(linear)
    if g_out.bias is not None:  # Kimi-Linear's and BailingHybrid's output gates have none
        sharder.cut(g_out, "bias", 0, channels)
    for attribute in ("q_conv", "k_conv", "v_conv", "dt_bias"):
        sharder.cut(layer, attribute, 0, channels)
    sharder.cut(layer, "A_log", 0, heads)
    sharder.cut(layer.b_proj, "weight", 0, heads)
    _set_linear_sizes(layer.b_proj)
    sharder.cut(layer.o_proj, "weight", 1, channels)
    _set_linear_sizes(layer.o_proj)
    layer.num_heads //= size
    low_rank = [p[0].weight for p in (layer.f_proj, layer.g_proj) if isinstance(p, nn.Sequential)]
    return [sharder.name(p) for p in (*low_rank, layer.o_norm.weight)]


def shard_mla(sharder: Sharder, layer: MLALayer, rank: int, size: int) -> list[str]:
    config = layer.config
    heads = config.num_heads
    if layer.o_proj.bias is not None and size > 1:
        raise ValueError(f"tensor parallelism ({size}) of an MLA layer with mla.attention_bias is not supported: "
                         "the row-parallel o_proj would add its bias on every rank")
    partial = [p for p in (layer.kv_a_proj.weight, layer.kv_a_proj.bias, layer.kv_norm.weight) if p is not None]
    query = layer.q_proj
    if isinstance(query, nn.Sequential):
        partial += [p for p in (query[0].weight, query[0].bias, query[1].weight) if p is not None]
        query = query[2]
    sharder.cut(query, "weight", 0, head_index(heads, layer.qk_head_dim, rank, size))
    key_value_width = config.qk_nope_head_dim + config.v_head_dim
    sharder.cut(layer.kv_b_proj, "weight", 0, head_index(heads, key_value_width, rank, size))
    sharder.cut(layer.o_proj, "weight", 1, head_index(heads, config.v_head_dim, rank, size))
    linears = [query, layer.kv_b_proj, layer.o_proj]
    if layer.g_proj is not None:  # the output gate's rows are per head
        sharder.cut(layer.g_proj, "weight", 0, head_index(heads, 1, rank, size))
        linears.append(layer.g_proj)
    for linear in linears:
        _set_linear_sizes(linear)
    layer.config = replace(config, num_heads=heads // size)
    return [sharder.name(p) for p in partial]


def shard_swiglu(sharder: Sharder, mlp: SwiGLU, rank: int, size: int) -> list[str]:
    intermediate = mlp.down.weight.shape[1]
    sharder.cut(mlp.gate_up, "weight", 0, halves_index(intermediate, rank, size))
    sharder.cut(mlp.down, "weight", 1, head_index(intermediate, 1, rank, size))
    _set_linear_sizes(mlp.gate_up)
    _set_linear_sizes(mlp.down)
    return []


def install_region_hooks(module: nn.Module, group, *, sequence_parallel: bool, whole_paths: bool) -> None:
    """Run `module` (sharded) as a tensor-parallel region; `whole_paths`: its forward is (x, layout)."""
    size = group_size(group)

    def enter(_module, args):
        x = args[0]
        if not sequence_parallel:
            return (copy_to_group(x, group), *args[1:])
        full = gather_rows(x, group, grad="reduce_scatter")
        if whole_paths:
            full = full[: args[1].num_rows]
        return (full, *args[1:])

    def leave(_module, args, out):
        if not sequence_parallel:
            return reduce_from_group(out, group)
        if whole_paths:
            out = pad_rows(out, size * padded_rows(args[1].num_rows, size))
        return reduce_scatter_rows(out, group)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
