"""Compact log-probs: next-token log-probabilities of semantic positions from compact rows.

`compact_logprobs(hidden_CD, lm_head_weight_VD, compact_index_S, targets_S)` returns
λ_s = z[m(s), y_s] − lse[m(s)] for every requested semantic position s, where z = hidden @ Wᵀ / T
are the LM-head logits of the compact rows at temperature T (default 1; DESIGN §5). The S
positions may be any subset of the step's semantic positions in any order (typically all of them
in original batch order, or only those that carry a loss); several may map to the same compact
row with different targets. With `return_entropy=True` it also returns the entropy
H_s = −Σ_v p_v log p_v of the tempered distribution p = softmax(z[m(s)]) of every position: a
function of the row alone, so it is computed once per compact row (C values) and gathered to the
S positions.

Legend: C compact rows, D hidden size, V vocabulary, S requested semantic positions, n rows of
one chunk, P the positions of one chunk.

Work and memory. Rows are processed in chunks of `chunk_rows`. The forward computes each chunk's
fp32 logits once (divided by T in place), reads every target logit out of it (exact: the value
that enters the log-sum-exp, and an O(S) gather instead of an O(S·D) dot product per position),
then its log-sum-exp and, with entropy, H_c = −Σ exp(z − lse)·(z − lse) (`harts.ops.logsumexp`:
for fp32 logits on CUDA one Triton pass reading each logit once; elsewhere `torch.logsumexp`,
then the chunk's log-probs z − lse in place and one more n×V buffer). It keeps only the inputs
(hidden, weight: already alive), lse (and H) (C floats each) and the index arrays (O(S)); the chunk's logits are dropped
before the next chunk is formed. The backward recomputes each chunk's logits, turns them in place
(`harts.ops.logit_grad`: one Triton pass on CUDA) into
    ∂L/∂z_c = Σ_{m(s)=c} g_s·onehot(y_s) − (Σ_{m(s)=c} g_s)·p_c − (Σ_{m(s)=c} h_s)·p_c ⊙ (log p_c + H_c)
i.e. Σ_s g_s·(onehot(y_s) − p_c) for the log-probs (each position's gradient formed on its own:
labels and upstream gradients of positions sharing a row all survive) plus, for the entropy's
upstream gradients h_s, ∂H/∂z = −p ⊙ (log p + H); then ∂L/∂(hidden @ Wᵀ) = ∂L/∂z / T,
dhidden = that @ W and dW += thatᵀ @ hidden chunk by chunk. So the largest temporary is one n×V
fp32 buffer (two with entropy gradients; plus an fp32 copy of W and an fp32 dW accumulator of V×D
when the inputs are not fp32; with grad_precision="input" no copy of W, but the n×V bf16 gradient
beside the fp32 logits, and dW summed in place into its fp32 accumulator); nothing S×V is ever
built and no C×V tensor outlives its chunk.
Vocabulary work: O(C·V·D) matmuls + O(S).

Precision: logits are computed in fp32 (fp64 inputs stay fp64) whatever the input dtype, so
bf16 hidden states and weights give fp32 logits and fp32 log-probs; gradients are returned in
the inputs' dtypes. For bf16/fp16 hidden states and weight on CUDA the logits (forward, and their
recomputation in backward) come from the bf16/fp16 tensor cores with an fp32 result
(`mm(..., out_dtype=float32)`: the products are exact and accumulate in fp32, so the values are
those of an fp32 matmul, at twice the TF32 rate), and the backward's two gradient matmuls run on
TF32 tensor cores: bf16 and fp16 values are exact in TF32; only the fp32 logit gradients are
rounded to TF32's 10-bit mantissa (finer than the bf16 a plain bf16 LM head would use). With
`grad_precision="input"` the logit gradients are instead rounded once to the inputs' bf16/fp16 (the
kernel writes them so; the few elements at the targets are formed again in fp32 with their one-hot
terms and rounded once) and the gradient matmuls take them on that dtype's tensor cores with fp32
accumulation (CPU: the same values through fp32), at twice the TF32 rate;
tests/objective/test_logprobs.py checks the single rounding bit for bit. fp32 and fp64 inputs keep
full-precision matmuls (there "input" is "fp32"); fp16 gradients below fp16's range flush to zero.
The per-row sums (Σ g_s via `index_add_`, the one-hot terms via `index_put_(accumulate=True)`) are
deterministic on CPU; on CUDA they use atomics unless `torch.use_deterministic_algorithms(True)` is
set.

Reference: `naive_compact_logprobs` expands hidden to the S semantic rows, builds the S×V
logits, divides by T, applies log_softmax, gathers and sums −p·log p, all under autograd; the
tests (tests/objective/test_logprobs.py) compare forward and both gradients with it, entropy and
temperatures ≠ 1 included.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from harts.config.execution import DEFAULT_LOGPROB_CHUNK_ROWS, GRAD_PRECISIONS
from harts.ops.logit_grad import logit_grad
from harts.ops.logsumexp import logsumexp_entropy

HALF = (torch.bfloat16, torch.float16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@contextlib.contextmanager
def _tensor_cores(hidden_CD: torch.Tensor, weight_VD: torch.Tensor):
    """TF32 tensor cores for the fp32 matmuls when hidden and weight are both bf16/fp16 on CUDA
    (see Precision; an fp32 weight would be rounded)."""
    if hidden_CD.device.type != "cuda" or hidden_CD.dtype not in HALF or weight_VD.dtype not in HALF:
        yield
        return
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def _check_inputs(
    hidden_CD: torch.Tensor, weight_VD: torch.Tensor, compact_index_S: torch.Tensor, targets_S: torch.Tensor,
    temperature: float,
) -> None:
    if hidden_CD.dim() != 2 or weight_VD.dim() != 2:
        raise ValueError(
            f"compact_logprobs: hidden must be [C, D] and weight [V, D], got {tuple(hidden_CD.shape)} "
            f"and {tuple(weight_VD.shape)}"
        )
    if hidden_CD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"compact_logprobs: hidden size {hidden_CD.shape[1]} != LM-head input size {weight_VD.shape[1]}"
        )
    if compact_index_S.dim() != 1 or compact_index_S.shape != targets_S.shape:
        raise ValueError(
            f"compact_logprobs: compact_index and targets must be 1-D of equal length, got "
            f"{tuple(compact_index_S.shape)} and {tuple(targets_S.shape)}"
        )
    if compact_index_S.dtype != torch.int64 or targets_S.dtype != torch.int64:
        raise ValueError(
            f"compact_logprobs: compact_index and targets must be int64, got {compact_index_S.dtype} "
            f"and {targets_S.dtype}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"compact_logprobs: temperature must be a finite number > 0, got {temperature!r}")
    if compact_index_S.numel():
        num_rows, vocab = hidden_CD.shape[0], weight_VD.shape[0]
        if int(compact_index_S.min()) < 0 or int(compact_index_S.max()) >= num_rows:
            raise ValueError(f"compact_logprobs: compact_index out of range [0, {num_rows})")
        if int(targets_S.min()) < 0 or int(targets_S.max()) >= vocab:
            raise ValueError(f"compact_logprobs: targets out of range [0, {vocab})")


def _half_operands(hidden_CD: torch.Tensor, weight_VD: torch.Tensor) -> bool:
    """Hidden states and weight are bf16/fp16 of one dtype."""
    return hidden_CD.dtype == weight_VD.dtype and hidden_CD.dtype in HALF


def _half_precision_logits(hidden_CD: torch.Tensor, weight_VD: torch.Tensor) -> bool:
    """Logits straight from bf16/fp16 operands of one dtype on CUDA (see Precision)."""
    return hidden_CD.is_cuda and _half_operands(hidden_CD, weight_VD)


def _tempered_logits(hidden_nD: torch.Tensor, weight_VD: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = hidden @ Wᵀ / T in fp32 or fp64 (a fresh n×V buffer; the division is skipped at T = 1, where
    it is exact); bf16/fp16 operands (CUDA only) through their tensor cores with an fp32 result."""
    if hidden_nD.dtype in (torch.bfloat16, torch.float16):
        logits_nV = torch.mm(hidden_nD, weight_VD.T, out_dtype=torch.float32)
    else:
        logits_nV = hidden_nD @ weight_VD.T
    if temperature != 1.0:
        logits_nV.div_(temperature)
    return logits_nV


class _CompactLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden_CD, weight_VD, compact_index_S, targets_S, chunk_rows, temperature, return_entropy, grad_precision
    ):
        ctx.grad_precision = grad_precision
        with _tensor_cores(hidden_CD, weight_VD):
            return _CompactLogprobs._forward(
                ctx, hidden_CD, weight_VD, compact_index_S, targets_S, chunk_rows, temperature, return_entropy
            )

    @staticmethod
    def _forward(ctx, hidden_CD, weight_VD, compact_index_S, targets_S, chunk_rows, temperature, return_entropy):
        num_rows = hidden_CD.shape[0]
        dtype = _compute_dtype(hidden_CD.dtype)
        half = _half_precision_logits(hidden_CD, weight_VD)
        weight_f = weight_VD if half else weight_VD.to(dtype)
        # Positions sorted by compact row: each chunk owns one contiguous range of them.
        order_S = torch.argsort(compact_index_S, stable=True)
        rows_sorted_S = compact_index_S[order_S]
        targets_sorted_S = targets_S[order_S]
        starts = list(range(0, num_rows, chunk_rows)) + [num_rows]
        bounds = torch.searchsorted(
            rows_sorted_S, torch.tensor(starts, dtype=torch.int64, device=rows_sorted_S.device)
        ).tolist()

        lse_C = torch.empty(num_rows, dtype=dtype, device=hidden_CD.device)
        entropy_C = torch.empty(num_rows, dtype=dtype, device=hidden_CD.device) if return_entropy else None
        out_sorted_S = torch.empty(len(order_S), dtype=dtype, device=hidden_CD.device)
        for k in range(len(starts) - 1):
            r0, r1, p0, p1 = starts[k], starts[k + 1], bounds[k], bounds[k + 1]
            hidden_nD = hidden_CD[r0:r1] if half else hidden_CD[r0:r1].to(dtype)
            logits_nV = _tempered_logits(hidden_nD, weight_f, temperature)
            local = rows_sorted_S[p0:p1] - r0
            # The targets' logits first: with entropy, the PyTorch form turns the chunk into log-probs in place.
            target_logits_P = logits_nV[local, targets_sorted_S[p0:p1]]
            lse_n, entropy_n = logsumexp_entropy(logits_nV, entropy=return_entropy)
            del logits_nV
            lse_C[r0:r1] = lse_n
            out_sorted_S[p0:p1] = target_logits_P - lse_n[local]
            if return_entropy:
                entropy_C[r0:r1] = entropy_n
        logprobs_S = torch.empty_like(out_sorted_S)
        logprobs_S[order_S] = out_sorted_S

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden_CD, weight_VD, lse_C, entropy_C, order_S, rows_sorted_S, targets_sorted_S)
        ctx.starts, ctx.bounds, ctx.temperature = starts, bounds, temperature
        if return_entropy:
            return logprobs_S, entropy_C[compact_index_S]
        return logprobs_S

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_S, grad_entropy_S=None):
        hidden_CD, weight_VD = ctx.saved_tensors[:2]
        with _tensor_cores(hidden_CD, weight_VD):
            return _CompactLogprobs._backward(ctx, grad_S, grad_entropy_S)

    @staticmethod
    def _backward(ctx, grad_S, grad_entropy_S):
        hidden_CD, weight_VD, lse_C, entropy_C, order_S, rows_sorted_S, targets_sorted_S = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_S is None and grad_entropy_S is None:
            return None, None, None, None, None, None, None, None
        dtype = lse_C.dtype
        half = _half_precision_logits(hidden_CD, weight_VD)
        half_grads = ctx.grad_precision == "input" and _half_operands(hidden_CD, weight_VD)
        weight_f = None if half and half_grads else weight_VD.to(dtype)
        temperature = ctx.temperature
        grad_sorted_S = None if grad_S is None else grad_S[order_S].to(dtype)
        grad_sum_C = torch.zeros_like(lse_C)
        if grad_sorted_S is not None:
            grad_sum_C.index_add_(0, rows_sorted_S, grad_sorted_S)
        grad_entropy_C = None
        if grad_entropy_S is not None:
            grad_entropy_C = torch.zeros_like(lse_C).index_add_(0, rows_sorted_S, grad_entropy_S[order_S].to(dtype))
        if half_grads and temperature != 1.0:
            # 1/T folded into the per-row factors and one-hot terms: the half-precision gradient is rounded once.
            grad_sum_C.div_(temperature)
            grad_sorted_S = None if grad_sorted_S is None else grad_sorted_S / temperature
            grad_entropy_C = None if grad_entropy_C is None else grad_entropy_C.div_(temperature)

        grad_hidden = torch.empty_like(hidden_CD) if need_hidden else None
        grad_weight_f = torch.zeros_like(weight_VD, dtype=dtype) if need_weight else None
        starts, bounds = ctx.starts, ctx.bounds
        for k in range(len(starts) - 1):
            r0, r1, p0, p1 = starts[k], starts[k + 1], bounds[k], bounds[k + 1]
            hidden_nD = hidden_CD[r0:r1] if half or half_grads else hidden_CD[r0:r1].to(dtype)
            logits_nV = _tempered_logits(
                hidden_nD if half else hidden_nD.to(dtype), weight_VD if half else weight_f, temperature
            )
            row_terms = (
                lse_C[r0:r1], grad_sum_C[r0:r1], None if grad_entropy_C is None else entropy_C[r0:r1],
                None if grad_entropy_C is None else grad_entropy_C[r0:r1],
            )
            if half_grads:
                grad_logits_nV = logit_grad(logits_nV, *row_terms, out_dtype=hidden_CD.dtype)
                if grad_sorted_S is not None:
                    _add_onehot_rounded(grad_logits_nV, logits_nV, row_terms, rows_sorted_S[p0:p1] - r0,
                                        targets_sorted_S[p0:p1], grad_sorted_S[p0:p1])
                del logits_nV
                if need_hidden:
                    grad_hidden[r0:r1] = _half_matmul(grad_logits_nV, weight_VD).to(hidden_CD.dtype)
                if need_weight:
                    _half_addmm_(grad_weight_f, grad_logits_nV.T, hidden_nD)
                del grad_logits_nV
                continue
            grad_logits_nV = logit_grad(logits_nV, *row_terms)
            if grad_sorted_S is not None:
                grad_logits_nV.index_put_(
                    (rows_sorted_S[p0:p1] - r0, targets_sorted_S[p0:p1]), grad_sorted_S[p0:p1], accumulate=True
                )
            if temperature != 1.0:
                grad_logits_nV.div_(temperature)
            if need_hidden:
                grad_hidden[r0:r1] = (grad_logits_nV @ weight_f).to(hidden_CD.dtype)
            if need_weight:
                grad_weight_f.addmm_(grad_logits_nV.T, hidden_nD.to(dtype))
            del logits_nV, grad_logits_nV
        grad_weight = grad_weight_f.to(weight_VD.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _add_onehot_rounded(grad_half_nV, logits_nV, row_terms, local_P, targets_P, grad_P) -> None:
    """Adds the one-hot terms Σ g_s at each position's (row, target) to the half-precision gradient with
    one rounding: that element's fp32 gradient is formed again from its logit, the g_s of positions
    sharing it summed on top (in the fp32 logits buffer, free once the gradient is written), and the
    sum rounded into the half tensor."""
    flat_P = local_P * logits_nV.shape[1] + targets_P
    logits_flat = logits_nV.view(-1)
    lse, grad_sum, entropy, grad_entropy = (None if t is None else t[local_P] for t in row_terms)
    logits_flat[flat_P] = logit_grad(logits_flat[flat_P][:, None], lse, grad_sum, entropy, grad_entropy)[:, 0]
    logits_flat.index_put_((flat_P,), grad_P, accumulate=True)
    grad_half_nV.view(-1)[flat_P] = logits_flat[flat_P].to(grad_half_nV.dtype)


def _half_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16/fp16 operands with an fp32 result: their tensor cores on CUDA (products exact, fp32
    accumulation), the same values through fp32 on CPU."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _half_addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b in place into fp32 `acc` (see `_half_matmul`). In place on CUDA too: given a result
    other than `acc`, addmm first copies `acc` into it, a V×D fp32 copy per chunk beside a second V×D buffer."""
    if a.is_cuda:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float())


def compact_logprobs(
    hidden_CD: torch.Tensor,
    lm_head_weight_VD: torch.Tensor,
    compact_index_S: torch.Tensor,
    targets_S: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS,
    temperature: float = 1.0,
    return_entropy: bool = False,
    grad_precision: str = "fp32",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities λ_s of targets y_s under the tempered logits of compact rows m(s).

    Args:
        hidden_CD: final hidden states of the C compact rows (after the final norm), [C, D].
        lm_head_weight_VD: LM-head weight, [V, D] (logits = hidden @ weightᵀ, no bias).
        compact_index_S: int64 [S], m(s): the compact row whose logits predict position s's target.
        targets_S: int64 [S], y_s: the next token of position s (in [0, V)).
        chunk_rows: compact rows per chunk; peak extra memory is one chunk_rows×V fp32 buffer
            (two with entropy).
        temperature: T > 0; the distribution is softmax(logits / T) (the sampling temperature of
            the rollouts, as RL trainers divide the logits by it).
        return_entropy: also return H_s, the entropy of position s's tempered distribution.
        grad_precision: "fp32" (default) keeps the logit gradients in fp32 (TF32 gradient matmuls for
            bf16/fp16 inputs on CUDA); "input" rounds them once to the bf16/fp16 inputs' dtype and runs
            the two gradient matmuls on its tensor cores with fp32 accumulation, as a bf16 LM head does
            (fp32/fp64 inputs: the same as "fp32"). See Precision.

    Returns:
        λ [S] in fp32 (fp64 for fp64 inputs), and with `return_entropy` the pair (λ [S], H [S]);
        both differentiable w.r.t. hidden and weight through a backward that recomputes each
        chunk's logits.

    Example:
        >>> hidden = torch.randn(5, 8, requires_grad=True)
        >>> weight = torch.randn(11, 8, requires_grad=True)
        >>> m = torch.tensor([0, 1, 2, 1, 3, 4])   # positions 1 and 3 share compact row 1
        >>> y = torch.tensor([3, 7, 2, 9, 0, 4])
        >>> compact_logprobs(hidden, weight, m, y, chunk_rows=2).sum().backward()
        >>> logprobs, entropy = compact_logprobs(hidden, weight, m, y, temperature=0.7, return_entropy=True)
    """
    if chunk_rows < 1:
        raise ValueError(f"compact_logprobs: chunk_rows must be >= 1, got {chunk_rows}")
    if grad_precision not in GRAD_PRECISIONS:
        raise ValueError(f"compact_logprobs: grad_precision must be one of {GRAD_PRECISIONS}, got {grad_precision!r}")
    _check_inputs(hidden_CD, lm_head_weight_VD, compact_index_S, targets_S, temperature)
    return _CompactLogprobs.apply(
        hidden_CD, lm_head_weight_VD, compact_index_S, targets_S, chunk_rows, float(temperature), return_entropy,
        grad_precision,
    )


def naive_compact_logprobs(
    hidden_CD: torch.Tensor,
    lm_head_weight_VD: torch.Tensor,
    compact_index_S: torch.Tensor,
    targets_S: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for `compact_logprobs`: expand to S rows, full S×V logits / T, log_softmax, gather
    (and −Σ p·log p), all under autograd."""
    _check_inputs(hidden_CD, lm_head_weight_VD, compact_index_S, targets_S, temperature)
    dtype = _compute_dtype(hidden_CD.dtype)
    logits_SV = hidden_CD[compact_index_S].to(dtype) @ lm_head_weight_VD.to(dtype).T / temperature
    log_p_SV = torch.log_softmax(logits_SV, dim=-1)
    logprobs_S = log_p_SV.gather(1, targets_S[:, None])[:, 0]
    if return_entropy:
        return logprobs_S, -(log_p_SV.exp() * log_p_SV).sum(dim=-1)
    return logprobs_S


@torch.no_grad()
def iter_compact_logits(
    hidden_CD: torch.Tensor, lm_head_weight_VD: torch.Tensor, *, chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS
) -> Iterator[tuple[int, torch.Tensor]]:
    """Full-vocabulary fp32 logits of the compact rows, chunk by chunk, without gradients.

    Yields (first_row, logits_nV) for consecutive chunks of at most `chunk_rows` rows; meant for
    fidelity measurements (per-row cosine against a baseline) that must not hold C×V at once.
    """
    if chunk_rows < 1:
        raise ValueError(f"iter_compact_logits: chunk_rows must be >= 1, got {chunk_rows}")
    dtype = _compute_dtype(hidden_CD.dtype)
    weight_f = lm_head_weight_VD.to(dtype)
    for r0 in range(0, hidden_CD.shape[0], chunk_rows):
        yield r0, hidden_CD[r0 : r0 + chunk_rows].to(dtype) @ weight_f.T
