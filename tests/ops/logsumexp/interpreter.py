"""Run `fused_logsumexp_entropy` on CPU under the Triton interpreter against `naive_logsumexp_entropy` (fp64). Run as
`TRITON_INTERPRET=1 python -m tests.ops.logsumexp.interpreter kernel` (test_logsumexp.py does, in a subprocess);
prints one JSON object: per case the worst row's error of lse and H in each mode, and what the fused pass gives on a
row of −inf only beside the PyTorch form."""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter

ROWS_OF_TILES = 3
"""Full tiles of a long row; its last tile holds 7 columns more (V not a multiple of the tile)."""


def row_error(actual, expected) -> float:
    """The worst row's |actual − expected| / max(|expected|, 1), in fp64: relative where the value is large (lse of
    logits offset by 1e4), absolute near 0."""
    expected = expected.double()
    return ((actual.double() - expected).abs() / expected.abs().clamp(min=1)).max().item()


def cases(block_columns: int) -> dict:
    """name -> fp32 logits [n, V] (seed 42). `masked` has −inf entries, a row whose first tile is all −inf and a
    last row of −inf only."""
    import torch

    gen = torch.Generator().manual_seed(42)
    long = ROWS_OF_TILES * block_columns + 7

    def randn(rows, vocab, scale=4.0):
        return torch.randn(rows, vocab, generator=gen) * scale

    masked = randn(4, long)
    masked[torch.rand(4, long, generator=gen) < 0.3] = float("-inf")
    masked[1, :block_columns] = float("-inf")
    masked[3] = float("-inf")
    return {
        "one-row-partial-tile": randn(1, 100),
        "random": randn(4, long),
        # The maximum moves into every new tile: the running sums must be rescaled each time.
        "rising": randn(3, long, 1.0) + torch.linspace(0, 40, long),
        # exp(z) overflows fp32 beyond 88: only the shifted sums survive these offsets.
        "offsets": randn(4, long) + torch.tensor([1e4, -1e4, 0.0, 100.0])[:, None],
        "masked": masked,
    }


def case_kernel() -> dict:
    import torch

    from harts.ops.logsumexp import fused, fused_logsumexp_entropy, naive_logsumexp_entropy

    results = {}
    for name, logits in cases(fused.BLOCK_COLUMNS).items():
        kept = logits.clone()
        lse_only, none = fused_logsumexp_entropy(logits)
        lse, entropy = fused_logsumexp_entropy(logits, entropy=True)
        results[f"{name}.unchanged"] = torch.equal(logits, kept) and none is None
        finite = ~torch.isneginf(logits).all(dim=1)
        ref_lse, _ = naive_logsumexp_entropy(logits.double())
        # The reference's entropy is NaN on a row with −inf entries (0·(−inf)): its finite entries hold the same
        # distribution.
        ref_entropy = torch.stack([naive_logsumexp_entropy(row[torch.isfinite(row)][None].double(), entropy=True)[1][0]
                                   for row in logits[finite]])
        results[f"{name}.lse"] = row_error(lse_only[finite], ref_lse[finite])
        results[f"{name}.lse_with_entropy"] = row_error(lse[finite], ref_lse[finite])
        results[f"{name}.entropy"] = row_error(entropy[finite], ref_entropy)
        if not finite.all():
            naive_lse, naive_entropy = naive_logsumexp_entropy(logits[~finite].clone(), entropy=True)
            results[f"{name}.all_inf_row"] = {
                "fused": [lse[~finite].tolist(), entropy[~finite].isnan().tolist()],
                "naive": [naive_lse.tolist(), naive_entropy.isnan().tolist()]}
    return results


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps({"kernel": case_kernel}[sys.argv[1]]()))
