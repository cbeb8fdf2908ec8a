import numpy as np
import pytest
import torch

from harts.objective.logprobs import compact_logprobs, iter_compact_logits, naive_compact_logprobs
from harts.objective.targets import semantic_targets_from_step

from .helpers import random_tree_step

# dtype: (forward max |Δ|, gradient max |Δ| / max |reference|)
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5)}


def _random_problem(dtype, *, num_rows=37, hidden=24, vocab=101, num_positions=150, seed=42):
    generator = torch.Generator().manual_seed(seed)
    hidden_CD = torch.randn(num_rows, hidden, generator=generator, dtype=torch.float64)
    weight_VD = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) / hidden**0.5
    # Every row used, many rows shared by several positions with different targets.
    compact_index = torch.cat(
        [torch.arange(num_rows), torch.randint(0, num_rows, (num_positions - num_rows,), generator=generator)]
    )
    compact_index = compact_index[torch.randperm(num_positions, generator=generator)]
    targets = torch.randint(0, vocab, (num_positions,), generator=generator)
    grad_S = torch.randn(num_positions, generator=generator, dtype=torch.float64)
    return hidden_CD.to(dtype), weight_VD.to(dtype), compact_index, targets, grad_S


def _forward_backward(function, hidden_CD, weight_VD, compact_index, targets, grad_S, entropy_grad_S=None, **kwargs):
    """(λ, [H,] dhidden, dweight) of upstream gradients grad_S on λ (and entropy_grad_S on H: then
    the entropy is requested; a None gradient leaves that output out of the loss)."""
    hidden_CD = hidden_CD.detach().clone().requires_grad_()
    weight_VD = weight_VD.detach().clone().requires_grad_()
    if entropy_grad_S is None and "return_entropy" not in kwargs:
        logprobs = function(hidden_CD, weight_VD, compact_index, targets, **kwargs)
        logprobs.backward(grad_S.to(logprobs.dtype))
        return logprobs.detach(), hidden_CD.grad, weight_VD.grad
    logprobs, entropy = function(hidden_CD, weight_VD, compact_index, targets, return_entropy=True, **{
        k: v for k, v in kwargs.items() if k != "return_entropy"})
    outputs, grads = zip(*[(out, g.to(out.dtype)) for out, g in ((logprobs, grad_S), (entropy, entropy_grad_S))
                           if g is not None])
    torch.autograd.backward(outputs, grads)
    return logprobs.detach(), entropy.detach(), hidden_CD.grad, weight_VD.grad


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 37, 1000], ids=lambda n: f"chunk{n}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_matches_naive(dtype, chunk_rows):
    problem = _random_problem(dtype)
    fast = _forward_backward(compact_logprobs, *problem, chunk_rows=chunk_rows)
    naive = _forward_backward(naive_compact_logprobs, *problem)
    forward_tol, grad_tol = TOLERANCES[dtype]
    assert fast[0].dtype == dtype
    assert float((fast[0] - naive[0]).abs().max()) <= forward_tol
    assert _relative(fast[1], naive[1]) <= grad_tol
    assert _relative(fast[2], naive[2]) <= grad_tol


# Which outputs carry an upstream gradient: both, the log-probs only (entropy returned but unused:
# its backward terms are skipped) or the entropy only (no one-hot terms).
GRADIENTS = {"both": (True, True), "logprobs-only": (True, False), "entropy-only": (False, True)}


@pytest.mark.parametrize("grads", GRADIENTS)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("chunk_rows", [1, 16, 1000], ids=lambda n: f"chunk{n}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_temperature_and_entropy_match_naive(dtype, chunk_rows, temperature, grads):
    """λ and H of softmax(z / T), forward and both gradients, against the S×V reference. fp32: the
    reference sums S×V terms in another order; measured errors are ~1e-6 (H ≈ log V ≈ 4.6 summed
    over 101 terms), so 1e-5 as for the log-probs."""
    hidden_CD, weight_VD, compact_index, targets, grad_S = _random_problem(dtype)
    entropy_grad_S = torch.randn(len(targets), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with_logprobs, with_entropy = GRADIENTS[grads]
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S if with_logprobs else None,
               entropy_grad_S if with_entropy else None)
    kwargs = dict(temperature=temperature, return_entropy=True)
    fast = _forward_backward(compact_logprobs, *problem, chunk_rows=chunk_rows, **kwargs)
    naive = _forward_backward(naive_compact_logprobs, *problem, **kwargs)
    forward_tol, grad_tol = TOLERANCES[dtype]
    assert fast[0].dtype == fast[1].dtype == dtype
    assert float((fast[0] - naive[0]).abs().max()) <= forward_tol
    assert float((fast[1] - naive[1]).abs().max()) <= forward_tol
    assert _relative(fast[2], naive[2]) <= grad_tol
    assert _relative(fast[3], naive[3]) <= grad_tol


def _pytorch_passes_forward(hidden_CD, weight_VD, compact_index, targets, *, chunk_rows, temperature):
    """The forward as `_CompactLogprobs` computed it before `harts.ops.logsumexp`: per chunk `torch.logsumexp`, the
    targets' logits minus lse, then H from the log-probs formed in place."""
    logprobs = torch.empty(len(targets), dtype=hidden_CD.dtype)
    entropy = torch.empty(len(hidden_CD), dtype=hidden_CD.dtype)
    for r0 in range(0, len(hidden_CD), chunk_rows):
        logits_nV = hidden_CD[r0:r0 + chunk_rows] @ weight_VD.T
        if temperature != 1.0:
            logits_nV.div_(temperature)
        lse_n = torch.logsumexp(logits_nV, dim=-1)
        on_chunk = (compact_index >= r0) & (compact_index < r0 + chunk_rows)
        local = compact_index[on_chunk] - r0
        logprobs[on_chunk] = logits_nV[local, targets[on_chunk]] - lse_n[local]
        log_p_nV = logits_nV.sub_(lse_n[:, None])
        entropy[r0:r0 + chunk_rows] = -(log_p_nV.exp().mul_(log_p_nV).sum(dim=-1))
    return logprobs, entropy[compact_index]


@pytest.mark.parametrize("temperature", [1.0, 0.6], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("chunk_rows", [1, 16, 1000], ids=lambda n: f"chunk{n}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_cpu_forward_is_the_pytorch_passes_bit_for_bit(dtype, chunk_rows, temperature):
    """On CPU `harts.ops.logsumexp` dispatches to the same PyTorch ops as before it existed: the same bits."""
    hidden_CD, weight_VD, compact_index, targets, _ = _random_problem(dtype)
    expected = _pytorch_passes_forward(hidden_CD, weight_VD, compact_index, targets, chunk_rows=chunk_rows,
                                       temperature=temperature)
    kwargs = dict(chunk_rows=chunk_rows, temperature=temperature)
    logprobs, entropy = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, return_entropy=True, **kwargs)
    assert torch.equal(logprobs, expected[0]) and torch.equal(entropy, expected[1])
    assert torch.equal(compact_logprobs(hidden_CD, weight_VD, compact_index, targets, **kwargs), expected[0])


def test_temperature_is_a_logit_scale():
    """softmax(z / T) computed from scratch: λ at T equals λ of the weight divided by T at T = 1
    (fp64: the two differ only by the rounding of one division per logit)."""
    hidden_CD, weight_VD, compact_index, targets, _ = _random_problem(torch.float64)
    tempered = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=8, temperature=0.5)
    scaled = compact_logprobs(hidden_CD, weight_VD / 0.5, compact_index, targets, chunk_rows=8)
    assert float((tempered - scaled).abs().max()) <= 1e-12
    assert float((tempered - compact_logprobs(hidden_CD, weight_VD, compact_index, targets)).abs().max()) > 1e-2


def test_entropy_is_per_row():
    """Positions on one row get the row's entropy, bitwise (gathered, not recomputed), and it is
    that of the row's full distribution: between 0 and log V."""
    hidden_CD, weight_VD, compact_index, targets, _ = _random_problem(torch.float64)
    _, entropy = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=8, return_entropy=True)
    per_row = torch.full((hidden_CD.shape[0],), float("nan"), dtype=torch.float64)
    per_row[compact_index] = entropy
    assert torch.equal(entropy, per_row[compact_index])
    probs = torch.softmax(hidden_CD @ weight_VD.T, dim=-1)
    assert torch.allclose(per_row, -(probs * probs.log()).sum(-1), rtol=0, atol=1e-12)
    assert (per_row > 0).all() and (per_row < np.log(weight_VD.shape[0])).all()


def test_shared_row_gradients_are_summed_per_position():
    # Two positions on one row with different targets and upstream gradients, one on another row.
    hidden_CD, weight_VD, _, _, _ = _random_problem(torch.float64, num_rows=2, vocab=7)
    compact_index = torch.tensor([0, 0, 1])
    targets = torch.tensor([3, 5, 3])
    grad_S = torch.tensor([0.7, -1.3, 0.0], dtype=torch.float64)
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S)
    _, grad_hidden, grad_weight = _forward_backward(compact_logprobs, *problem)
    softmax = torch.softmax(hidden_CD[0] @ weight_VD.T, dim=-1)
    grad_logits = 0.7 * (torch.nn.functional.one_hot(torch.tensor(3), 7) - softmax) + (-1.3) * (
        torch.nn.functional.one_hot(torch.tensor(5), 7) - softmax
    )
    assert torch.allclose(grad_hidden[0], grad_logits @ weight_VD, rtol=0, atol=1e-12)
    assert torch.equal(grad_hidden[1], torch.zeros_like(grad_hidden[1]))
    assert torch.allclose(grad_weight, torch.outer(grad_logits, hidden_CD[0]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "with-entropy"])
def test_gradcheck(entropy):
    hidden_CD, weight_VD, compact_index, targets, _ = _random_problem(
        torch.float64, num_rows=6, hidden=5, vocab=9, num_positions=14
    )
    inputs = (hidden_CD.requires_grad_(), weight_VD.requires_grad_())
    assert torch.autograd.gradcheck(
        lambda h, w: compact_logprobs(
            h, w, compact_index, targets, chunk_rows=4, temperature=0.8 if entropy else 1.0, return_entropy=entropy
        ), inputs
    )


@pytest.mark.parametrize("needs", ["hidden", "weight"])
def test_gradient_of_one_input_only(needs):
    hidden_CD, weight_VD, compact_index, targets, grad_S = _random_problem(torch.float64)
    hidden_CD.requires_grad_(needs == "hidden")
    weight_VD.requires_grad_(needs == "weight")
    compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=8).backward(grad_S)
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S)
    reference = _forward_backward(naive_compact_logprobs, *problem)
    got, expected = (hidden_CD.grad, reference[1]) if needs == "hidden" else (weight_VD.grad, reference[2])
    assert _relative(got, expected) <= 1e-12
    assert (weight_VD.grad if needs == "hidden" else hidden_CD.grad) is None


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "with-entropy"])
def test_keeps_nothing_vocabulary_sized(entropy):
    hidden_CD, weight_VD, compact_index, targets, _ = _random_problem(torch.float32, num_rows=40, vocab=200)
    hidden_CD.requires_grad_()
    out = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=8, return_entropy=entropy)
    saved = [t for t in (out[0] if entropy else out).grad_fn.saved_tensors if t is not None]
    largest_input = max(hidden_CD.numel(), weight_VD.numel(), len(targets))
    vocab_sized = [t.shape for t in saved if t.numel() > largest_input]
    assert vocab_sized == []
    rows = 40 * (2 if entropy else 1)  # lse (and the entropy) per compact row
    assert sum(t.numel() for t in saved) <= hidden_CD.numel() + weight_VD.numel() + rows + 3 * len(targets)


def test_bf16_inputs_give_fp32_logprobs():
    hidden_CD, weight_VD, compact_index, targets, grad_S = _random_problem(torch.bfloat16)
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S)
    fast = _forward_backward(compact_logprobs, *problem, chunk_rows=6)
    exact = _forward_backward(
        naive_compact_logprobs, hidden_CD.float(), weight_VD.float(), compact_index, targets, grad_S
    )
    assert fast[0].dtype == torch.float32 and fast[1].dtype == fast[2].dtype == torch.bfloat16
    assert float((fast[0] - exact[0]).abs().max()) <= 1e-5
    assert _relative(fast[1].float(), exact[1]) <= 1e-2
    assert _relative(fast[2].float(), exact[2]) <= 1e-2


@pytest.mark.parametrize("grads", GRADIENTS)
def test_half_precision_grads_round_once(grads):
    """grad_precision="input" rounds each logit gradient once to bf16, then multiplies exactly: with an
    identity LM head (V = D, so dhidden is the logit gradient itself) at T = 1 its dhidden equals the
    fp32 path's rounded dhidden bit for bit, duplicate (row, target) positions and entropy included
    (a second rounding, e.g. at the targets' one-hot terms, breaks it)."""
    generator = torch.Generator().manual_seed(42)
    num_rows, size = 29, 64
    hidden_CD = (torch.randn(num_rows, size, generator=generator) * 3).bfloat16()
    weight_VD = torch.eye(size, dtype=torch.bfloat16)
    compact_index = torch.cat([torch.arange(num_rows), torch.randint(0, num_rows, (60,), generator=generator)])
    targets = torch.randint(0, size, compact_index.shape, generator=generator)
    compact_index, targets = torch.cat([compact_index, compact_index[:9]]), torch.cat([targets, targets[:9]])
    grad_S = torch.randn(len(targets), generator=generator, dtype=torch.float64)
    entropy_grad_S = torch.randn(len(targets), generator=generator, dtype=torch.float64)
    with_logprobs, with_entropy = GRADIENTS[grads]
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S if with_logprobs else None,
               entropy_grad_S if with_entropy else None)
    fp32 = _forward_backward(compact_logprobs, *problem, chunk_rows=8, return_entropy=True)
    half = _forward_backward(compact_logprobs, *problem, chunk_rows=8, return_entropy=True, grad_precision="input")
    assert torch.equal(half[0], fp32[0]) and torch.equal(half[1], fp32[1])
    assert half[2].dtype == torch.bfloat16 and torch.equal(half[2], fp32[2])


@pytest.mark.parametrize("temperature", [1.0, 0.6], ids=lambda t: f"T{t}")
def test_half_precision_grads_match_naive(temperature):
    """bf16 inputs with grad_precision="input": gradients within bf16 rounding of the fp32 reference
    (1/T folded into the per-row factors)."""
    hidden_CD, weight_VD, compact_index, targets, grad_S = _random_problem(torch.bfloat16)
    entropy_grad_S = torch.randn(len(targets), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S, entropy_grad_S)
    kwargs = {"temperature": temperature, "return_entropy": True}
    half = _forward_backward(compact_logprobs, *problem, chunk_rows=6, grad_precision="input", **kwargs)
    exact = _forward_backward(naive_compact_logprobs, hidden_CD.float(), weight_VD.float(), *problem[2:], **kwargs)
    assert half[2].dtype == half[3].dtype == torch.bfloat16
    assert _relative(half[2].float(), exact[2]) <= 1e-2
    assert _relative(half[3].float(), exact[3]) <= 1e-2


def test_random_tree_semantic_positions():
    """A real trie: labels, gradients and masks differ on shared rows; fp32 within 1e-5."""
    rng = np.random.default_rng(42)
    tree = random_tree_step(rng, num=12, max_len=30, vocab=5)
    targets = semantic_targets_from_step(tree.step)
    assert tree.num_compact < tree.step.num_semantic_tokens
    generator = torch.Generator().manual_seed(42)
    hidden_CD = torch.randn(tree.num_compact, 16, generator=generator)
    weight_VD = torch.randn(5, 16, generator=generator)
    compact_index = torch.from_numpy(tree.compact_map)
    targets_S = torch.from_numpy(targets.targets)
    grad_S = torch.randn(len(targets_S), generator=generator, dtype=torch.float64)
    grad_S = grad_S * torch.from_numpy(targets.loss_mask)
    problem = (hidden_CD, weight_VD, compact_index, targets_S, grad_S)
    fast = _forward_backward(compact_logprobs, *problem, chunk_rows=7)
    naive = _forward_backward(naive_compact_logprobs, *problem)
    assert float((fast[0] - naive[0]).abs().max()) <= 1e-5
    assert _relative(fast[1], naive[1]) <= 1e-5
    assert _relative(fast[2], naive[2]) <= 1e-5


def test_empty_positions():
    hidden_CD, weight_VD, _, _, _ = _random_problem(torch.float64)
    hidden_CD.requires_grad_()
    empty = torch.zeros(0, dtype=torch.int64)
    logprobs = compact_logprobs(hidden_CD, weight_VD, empty, empty, chunk_rows=8)
    logprobs.sum().backward()
    assert logprobs.shape == (0,) and torch.equal(hidden_CD.grad, torch.zeros_like(hidden_CD))


@pytest.mark.parametrize(
    "case",
    [
        "row-out-of-range", "target-out-of-range", "negative-row", "int32-index", "length-mismatch",
        "hidden-size", "chunk0", "temperature0", "temperature-nan", "temperature-inf", "grad-precision",
    ],
)
def test_bad_inputs(case):
    hidden_CD, weight_VD, compact_index, targets, _ = _random_problem(torch.float32)
    chunk_rows, temperature, precision = 4, 1.0, "fp32"
    if case == "row-out-of-range":
        compact_index = compact_index.clone()
        compact_index[3] = hidden_CD.shape[0]
    elif case == "target-out-of-range":
        targets = targets.clone()
        targets[0] = weight_VD.shape[0]
    elif case == "negative-row":
        compact_index = compact_index.clone()
        compact_index[0] = -1
    elif case == "int32-index":
        compact_index = compact_index.int()
    elif case == "length-mismatch":
        targets = targets[:-1]
    elif case == "hidden-size":
        weight_VD = weight_VD[:, :-1]
    elif case.startswith("temperature"):
        temperature = {"temperature0": 0.0, "temperature-nan": float("nan"), "temperature-inf": float("inf")}[case]
    elif case == "grad-precision":
        precision = "bf16"
    else:
        chunk_rows = 0
    with pytest.raises(ValueError, match="compact_logprobs"):
        compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=chunk_rows, temperature=temperature,
                         grad_precision=precision)


def test_iter_compact_logits_covers_all_rows():
    hidden_CD, weight_VD, _, _, _ = _random_problem(torch.float32)
    chunks = list(iter_compact_logits(hidden_CD, weight_VD, chunk_rows=10))
    assert [start for start, _ in chunks] == [0, 10, 20, 30]
    # A chunk's matmul may block its sums differently from the whole one (BLAS kernels and
    # thread counts differ by CPU), so rows agree to the fp32 dot-product error bound
    # D·eps·Σ|h||w|, not bitwise; a misplaced or missing row is off by O(1).
    chunked = torch.cat([logits for _, logits in chunks])
    bound = hidden_CD.shape[1] * torch.finfo(torch.float32).eps * (hidden_CD.abs() @ weight_VD.abs().T)
    assert ((chunked - hidden_CD @ weight_VD.T).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_bounded_memory():
    """bf16 on GPU (TF32 tensor cores): matches the IEEE fp32 reference; peak memory stays below half of C×V fp32 (so no
    chunk's logits outlive it, as they would under plain autograd) and far below S×V."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(42)
    num_rows, hidden, vocab, sharing = 8192, 256, 32768, 4
    hidden_CD = torch.randn(num_rows, hidden, device=device, generator=generator).bfloat16().requires_grad_()
    weight_VD = torch.randn(vocab, hidden, device=device, generator=generator) / hidden**0.5
    weight_VD = weight_VD.bfloat16().requires_grad_()
    compact_index = torch.arange(num_rows, device=device).repeat(sharing)
    targets = torch.randint(0, vocab, compact_index.shape, device=device, generator=generator)
    grad_S = torch.randn(compact_index.shape, device=device, generator=generator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    precision = torch.backends.cuda.matmul.fp32_precision
    logprobs = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=512)
    logprobs.backward(grad_S)
    torch.cuda.synchronize()
    # The TF32 tensor cores of bf16 inputs are switched on for the call only.
    assert torch.backends.cuda.matmul.fp32_precision == precision
    peak = torch.cuda.max_memory_allocated() - base
    compact_logits_bytes = num_rows * vocab * 4
    assert peak < compact_logits_bytes / 2, (peak, compact_logits_bytes)
    reference = _forward_backward(
        naive_compact_logprobs, hidden_CD.float(), weight_VD.float(), compact_index, targets, grad_S
    )
    assert float((logprobs.detach() - reference[0]).abs().max()) <= 1e-4
    assert _relative(hidden_CD.grad.float(), reference[1]) <= 2e-2
    assert _relative(weight_VD.grad.float(), reference[2]) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.6], ids=lambda t: f"T{t}")
def test_cuda_half_precision_grads(temperature):
    """grad_precision="input" on CUDA (the fused pass into bf16, bf16 GEMMs with fp32 output): log-probs as the
    fp32 mode's, gradients within bf16 rounding of the fp32 reference, entropy and shared rows included."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(42)
    num_rows, hidden, vocab = 2048, 256, 32768
    hidden_CD = torch.randn(num_rows, hidden, device=device, generator=generator).bfloat16()
    weight_VD = (torch.randn(vocab, hidden, device=device, generator=generator) / hidden**0.5).bfloat16()
    compact_index = torch.arange(num_rows, device=device).repeat(3)
    targets = torch.randint(0, vocab, compact_index.shape, device=device, generator=generator)
    targets[num_rows:2 * num_rows] = targets[:num_rows]  # duplicate (row, target) positions
    grad_S = torch.randn(compact_index.shape, device=device, generator=generator, dtype=torch.float64)
    entropy_grad_S = torch.randn(compact_index.shape, device=device, generator=generator, dtype=torch.float64)
    problem = (hidden_CD, weight_VD, compact_index, targets, grad_S, entropy_grad_S)
    kwargs = {"temperature": temperature, "return_entropy": True}
    half = _forward_backward(compact_logprobs, *problem, chunk_rows=512, grad_precision="input", **kwargs)
    fp32 = _forward_backward(compact_logprobs, *problem, chunk_rows=512, **kwargs)
    exact = _forward_backward(naive_compact_logprobs, hidden_CD.float(), weight_VD.float(), *problem[2:], **kwargs)
    assert torch.equal(half[0], fp32[0]) and torch.equal(half[1], fp32[1])
    assert half[2].dtype == half[3].dtype == torch.bfloat16
    assert _relative(half[2].float(), exact[2]) <= 2e-2
    assert _relative(half[3].float(), exact[3]) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_forward_matches_the_pytorch_passes(dtype, monkeypatch):
    """On CUDA the forward's log-sum-exp and entropy come from the fused pass (`harts.ops.logsumexp`), at the LM
    head's vocabulary; log-probs and entropy as with the PyTorch passes that it replaces (fp32 rounding apart)."""
    from harts.objective import logprobs as module
    from harts.ops.logsumexp import fused, naive_logsumexp_entropy
    from tests.ops.kda.interpreter import counting_calls

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(42)
    num_rows, hidden, vocab = 4500, 256, 157184
    hidden_CD = torch.randn(num_rows, hidden, device=device, generator=generator).to(dtype)
    weight_VD = (torch.randn(vocab, hidden, device=device, generator=generator) * 2 / hidden**0.5).to(dtype)
    compact_index = torch.arange(num_rows, device=device).repeat(2)
    targets = torch.randint(0, vocab, compact_index.shape, device=device, generator=generator)
    kwargs = dict(chunk_rows=2048, temperature=0.7, return_entropy=True)
    with counting_calls(fused, "fused_logsumexp_entropy") as counts:
        logprobs, entropy = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, **kwargs)
    assert counts == {"fused_logsumexp_entropy": 3}
    monkeypatch.setattr(module, "logsumexp_entropy", naive_logsumexp_entropy)
    expected_logprobs, expected_entropy = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, **kwargs)
    assert float((logprobs - expected_logprobs).abs().max()) <= 1e-5
    assert float((entropy - expected_entropy).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_half_weight_gradient_accumulates_in_place():
    """grad_precision="input" on CUDA sums each chunk's bf16 dW GEMM into one fp32 V×D buffer in place: the same
    values as the out-of-place sum, and peak memory holds that buffer once (a new sum per chunk would hold it
    twice and copy it per chunk)."""
    from harts.objective.logprobs import _half_addmm_

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(42)
    a = torch.randn(1024, 256, device=device, generator=generator).bfloat16()
    b = torch.randn(256, 512, device=device, generator=generator).bfloat16()
    acc = torch.randn(1024, 512, device=device, generator=generator)
    expected = torch.addmm(acc, a, b, out_dtype=torch.float32)
    pointer = acc.data_ptr()
    assert _half_addmm_(acc, a, b) is acc and acc.data_ptr() == pointer
    assert torch.equal(acc, expected)

    num_rows, hidden, vocab = 2048, 1024, 32768
    hidden_CD = torch.randn(num_rows, hidden, device=device, generator=generator).bfloat16()
    weight_VD = (torch.randn(vocab, hidden, device=device, generator=generator) / hidden**0.5).bfloat16()
    weight_VD.requires_grad_()
    compact_index = torch.arange(num_rows, device=device)
    targets = torch.randint(0, vocab, compact_index.shape, device=device, generator=generator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logprobs = compact_logprobs(hidden_CD, weight_VD, compact_index, targets, chunk_rows=256, grad_precision="input")
    logprobs.sum().backward()
    torch.cuda.synchronize()
    accumulator_bytes = vocab * hidden * 4
    # In place: the fp32 accumulator, then its bf16 result beside it (1.5x), plus a chunk's buffers (0.375x).
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2 * accumulator_bytes, (peak, accumulator_bytes)
