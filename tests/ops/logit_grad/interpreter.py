"""Run `fused_logit_grad` on CPU under the Triton interpreter against `naive_logit_grad` (fp64). Run as
`TRITON_INTERPRET=1 python -m tests.ops.logit_grad.interpreter kernel` (test_logit_grad.py does, in a
subprocess); prints one JSON object: the relative error of every compared output."""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter

# (rows, vocabulary): one row, a vocabulary over several tiles and not a multiple of the tile.
SHAPES = [(1, 100), (7, 5000)]


def case_kernel() -> dict[str, float]:
    import torch

    from harts.ops.logit_grad import fused_logit_grad, naive_logit_grad
    from tests.ops.kda.helpers import relative_error

    errors = {}
    for rows, vocab in SHAPES:
        gen = torch.Generator().manual_seed(42)
        logits = torch.randn(rows, vocab, generator=gen) * 4
        lse = torch.logsumexp(logits, dim=-1)
        grad_sum, grad_entropy = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
        log_p = logits - lse[:, None]
        entropy = -(log_p.exp() * log_p).sum(-1)
        for name, terms in (("logprobs", (None, None)), ("entropy", (entropy, grad_entropy))):
            reference = naive_logit_grad(logits.double(), lse.double(), grad_sum.double(),
                                         *(None if t is None else t.double() for t in terms))
            for out_dtype in (None, torch.bfloat16):
                fused = fused_logit_grad(logits.clone(), lse, grad_sum, *terms, out_dtype=out_dtype)
                errors[f"{rows}x{vocab}.{name}.{out_dtype or 'in-place'}"] = relative_error(fused, reference)
    return errors


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps({"kernel": case_kernel}[sys.argv[1]]()))
