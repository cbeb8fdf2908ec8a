"""Run `fused_select_experts` on CPU under the Triton interpreter against `naive_select_experts`. Run as
`TRITON_INTERPRET=1 python -m tests.ops.routing.interpreter select` (test_select.py does, in a subprocess); prints one
JSON object: per case, the number of rows whose picks differ from the reference's."""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter

# id: (rows, experts, top_k, num_groups, topk_groups, dtype). Scores on a grid of eighths: many ties, and the
# group sums exact in bf16 (the interpreter truncates where a GPU rounds to nearest); rows not a multiple of the
# kernel's block; experts and groups not powers of two.
CASES = {
    "ling3-groups-bf16": (37, 128, 8, 8, 4, "bfloat16"),
    "groups-not-pow2-fp32": (20, 96, 6, 6, 3, "float32"),
    "no-groups-bf16": (33, 64, 4, 1, 1, "bfloat16"),
    "top1-fp16": (17, 12, 1, 1, 1, "float16"),
    "one-group-kept": (5, 32, 8, 4, 1, "float32"),
}


def run() -> dict[str, int]:
    import torch

    from harts.ops.routing import fused_select_experts, naive_select_experts

    differing = {}
    gen = torch.Generator().manual_seed(42)
    for name, (rows, experts, top_k, groups, kept, dtype) in CASES.items():
        x = (torch.randint(0, 24, (rows, experts), generator=gen) / 8).to(getattr(torch, dtype))
        got = fused_select_experts(x, top_k, groups, kept)
        assert got.dtype == torch.int64 and got.shape == (rows, top_k)
        differing[name] = int((got != naive_select_experts(x, top_k, groups, kept)).any(dim=1).sum())
    # NaN (either sign) above +inf, −0 equal to +0 (at index 0, ahead of the +0's), −inf and whole rows of equal
    # values: the sort's order
    x = torch.randn(9, 16, generator=gen)
    x[0, 3] = float("nan")
    x[1] = 0.0
    x[1, 0] = -0.0
    x[2, 7] = -float("nan")
    x[3, :4] = float("-inf")
    x[4] = float("-inf")
    explicit = {"special-values": (x, 4, 4, 2)}
    # group sums that tie only once rounded to the scores' dtype (256 + 1 in bf16, 2048 + 1 in fp16), the tie to
    # the lower group; a kept expert scoring −inf ahead of a masked one
    for name, row, dtype in (("group-sum-rounding-bf16", [256.0, 0.0, 256.0, 1.0, 250.0, 0.0], torch.bfloat16),
                             ("group-sum-rounding-fp16", [2048.0, 0.0, 2048.0, 1.0, 2000.0, 0.0], torch.float16)):
        explicit[name] = (torch.tensor([row], dtype=dtype), 2, 3, 1)
    explicit["kept-minus-inf"] = (torch.tensor([[0.0, 0.0, 0.0, 5.0, 5.0, float("-inf")]]), 3, 2, 1)
    for name, (x, top_k, groups, kept) in explicit.items():
        got = fused_select_experts(x, top_k, groups, kept)
        differing[name] = int((got != naive_select_experts(x, top_k, groups, kept)).any(dim=1).sum())
    return differing


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps({"select": run}[sys.argv[1]]()))
