"""`harts bench routing`: the MoE routing's expert selection timed on CUDA, the fused kernel against torch's top-k's.

At a model's MoE shape (`--model`, `--rows`), on random bf16 router logits: the layer's two selections, its
routed experts (sigmoid scores plus an expert bias, group-limited when the model's routing is) and its
load-balancing loss's top-k over all experts, each way: `harts.ops.routing.select_experts` (one Triton kernel
each) and torch's composition (`torch_topk_selection`: megatron-core's `group_limited_topk` of top-k's, a
scatter and a masked fill). The record holds both medians (CUDA events, `kda_handoff.cuda_timed`), their
ratio, whether the kernel equals `naive_select_experts` bit for bit (the exit status says it), and in how many
rows torch's composition picked another order or another expert set (its ties' order is unspecified, and a tie
between groups can lead to other experts).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from harts.args import positive_int, records_file

logger = logging.getLogger(__name__)


def torch_topk_selection(selection_NE, top_k: int, num_groups: int = 1, topk_groups: int = 1):
    """torch's composition of the same selection (megatron-core's `group_limited_topk`): int64 [N, top_k]."""
    import torch

    if num_groups == 1:
        return torch.topk(selection_NE, k=top_k, dim=-1).indices
    rows, num_experts = selection_NE.shape
    grouped = selection_NE.view(rows, num_groups, num_experts // num_groups)
    best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(topk_groups, dim=-1).indices
    allowed = torch.zeros(rows, num_groups, dtype=torch.bool, device=selection_NE.device).scatter(1, best, True)
    masked = grouped.masked_fill(~allowed[..., None], float("-inf")).view(rows, num_experts)
    return torch.topk(masked, k=top_k, dim=-1).indices


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("routing", help="GPU: time the MoE expert selection, fused kernel vs torch top-k's")
    parser.add_argument("--model", default="ling3-tiny", help="model config whose MoE routing is timed")
    parser.add_argument("--rows", type=positive_int, default=65536, help="rows of the timed call (T)")
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--out", type=records_file, default="reports/raw/kernels/routing.json")
    parser.set_defaults(run=run, files=lambda a: ([a.out], []))


def run(args: argparse.Namespace) -> int:
    import torch

    from harts.bench.kda_handoff import cuda_timed
    from harts.model.config import load_model_config
    from harts.ops.routing import naive_select_experts, select_experts
    from harts.tracking.records import make_record, write_records

    if not torch.cuda.is_available():
        raise ValueError("harts bench routing: needs a CUDA device (the kernel is Triton's)")
    moe = load_model_config(args.model).moe
    if moe is None:
        raise ValueError(f"harts bench routing: model {args.model!r} has no MoE layers")
    k, groups, kept = moe.top_k, moe.num_groups, moe.topk_groups
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.rows, moe.num_experts, generator=generator, device="cuda") * 2).bfloat16()
    bias = (torch.randn(moe.num_experts, generator=generator, device="cuda") * 0.01).bfloat16()
    scores = torch.sigmoid(logits)
    selection = scores + bias
    balance = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def fused():
        return select_experts(selection, k, groups, kept), select_experts(balance, k)

    def composed():
        return torch_topk_selection(selection, k, groups, kept), torch.topk(balance, k=k, dim=-1).indices

    experts, balance_top = fused()
    reference = naive_select_experts(selection.cpu(), k, groups, kept), naive_select_experts(balance.cpu(), k)
    equal = torch.equal(experts.cpu(), reference[0]) and torch.equal(balance_top.cpu(), reference[1])
    torch_experts, torch_balance = composed()

    def differing(a, b):
        return int((a != b).any(dim=1).sum()), int((a.sort(dim=1).values != b.sort(dim=1).values).any(dim=1).sum())

    fused_time = cuda_timed(fused, 3, args.repeats, "cuda")
    composed_time = cuda_timed(composed, 3, args.repeats, "cuda")
    rows_order, rows_sets = differing(experts, torch_experts)
    balance_order, balance_sets = differing(balance_top, torch_balance)
    config = {"model": args.model, "rows": args.rows, "num_experts": moe.num_experts, "top_k": k,
              "num_groups": groups, "topk_groups": kept, "dtype": "bf16", "repeats": args.repeats}
    results = {
        "fused_ms": fused_time["median_ms"], "torch_topk_ms": composed_time["median_ms"],
        "speedup": composed_time["median_ms"] / fused_time["median_ms"],
        "fused_equals_reference": equal,
        "torch_rows_other_order": rows_order, "torch_rows_other_experts": rows_sets,
        "torch_balance_rows_other_order": balance_order, "torch_balance_rows_other_experts": balance_sets,
        "fused": fused_time, "torch_topk": composed_time,
    }
    write_records([make_record("routing", config, results)], Path(args.out))
    logger.info(f"routing at {args.rows} rows: fused {results['fused_ms']:.3f} ms, torch top-k's "
                f"{results['torch_topk_ms']:.3f} ms ({results['speedup']:.2f}x); equal to the reference: {equal}; "
                f"rows where torch's top-k's ordered their picks otherwise {rows_order}, picked other experts "
                f"{rows_sets} (ties)")
    return 0 if equal else 1
