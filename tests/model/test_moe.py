import dataclasses
import warnings

import pytest
import torch

from harts.model.config import load_model_config
from harts.model.moe import (
    MoE,
    MoEConfig,
    aux_loss_scores,
    expert_assignment_counts,
    load_balancing_loss,
    router_z_loss,
    step_share,
    topk_routing,
    updated_expert_bias,
)


def _megatron():
    """megatron-core (a chosen dependency, the reference of the routing and losses), imported by the
    tests that compare with it, so that the others collect where it is absent (the GPU image)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns at import that TE and Apex are missing
        from megatron.core import parallel_state
        from megatron.core.transformer.moe import moe_utils
    return parallel_state, moe_utils


NUM_ROWS, NUM_EXPERTS = 64, 8

ROUTINGS = {
    # id: kwargs of topk_routing (the expert bias, when True, is drawn at random)
    "softmax-k2": dict(top_k=2, score_function="softmax"),
    "softmax-pre-k3-scaled": dict(
        top_k=3, score_function="softmax", softmax_before_topk=True, topk_scaling_factor=2.0
    ),
    "softmax-pre-k1": dict(top_k=1, score_function="softmax", softmax_before_topk=True),
    "sigmoid-k3": dict(top_k=3, score_function="sigmoid"),
    "sigmoid-k1": dict(top_k=1, score_function="sigmoid"),
    "sigmoid-bias-k4-scaled": dict(
        top_k=4, score_function="sigmoid", expert_bias_E=True, topk_scaling_factor=2.5
    ),
    # group-limited (k = 2·topk_groups, where megatron's top-(k/topk_groups) group score is the top-2 sum)
    "sigmoid-bias-groups-k2-scaled": dict(
        top_k=2, score_function="sigmoid", expert_bias_E=True, topk_scaling_factor=2.5, num_groups=2, topk_groups=1
    ),
}


def _logits(dtype=torch.float32, seed=42):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_ROWS, NUM_EXPERTS, generator=generator, dtype=dtype) * 2


def _dense(routing):
    probs = torch.zeros(NUM_ROWS, NUM_EXPERTS, dtype=routing.probs_NK.dtype).scatter(
        1, routing.experts_NK, routing.probs_NK
    )
    selected = torch.zeros(NUM_ROWS, NUM_EXPERTS, dtype=torch.bool).scatter(1, routing.experts_NK, True)
    return probs, selected


@pytest.mark.parametrize("name", ROUTINGS)
def test_routing_matches_megatron(name):
    _, moe_utils = _megatron()
    kwargs = dict(ROUTINGS[name])
    if kwargs.get("expert_bias_E"):
        kwargs["expert_bias_E"] = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(7)) * 0.3
    logits = _logits().requires_grad_()
    probs, selected = _dense(topk_routing(logits, **kwargs))
    upstream = torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((probs * upstream).sum(), logits)

    reference_logits = logits.detach().clone().requires_grad_()
    reference_probs, reference_map = moe_utils.topk_routing_with_score_function(
        reference_logits,
        kwargs["top_k"],
        use_pre_softmax=kwargs.get("softmax_before_topk", False),
        scaling_factor=kwargs.get("topk_scaling_factor"),
        score_function=kwargs["score_function"],
        expert_bias=kwargs.get("expert_bias_E"),
        num_groups=kwargs.get("num_groups"),
        group_topk=kwargs.get("topk_groups"),
    )
    (reference_grad,) = torch.autograd.grad((reference_probs * upstream).sum(), reference_logits)
    if kwargs.get("expert_bias_E") is not None:
        # The bias must change the selection here, or the case would not test it.
        assert not torch.equal(selected, _dense(topk_routing(logits, **{**kwargs, "expert_bias_E": None}))[1])
    if kwargs.get("num_groups", 1) > 1:  # and so must the group limit
        assert not torch.equal(selected, _dense(topk_routing(logits, **{**kwargs, "num_groups": 1}))[1])
    assert torch.equal(selected, reference_map)
    assert torch.allclose(probs, reference_probs, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, reference_grad, rtol=1e-5, atol=1e-7)


def test_z_loss_matches_megatron():
    _, moe_utils = _megatron()
    logits = _logits().requires_grad_()
    loss = router_z_loss(logits, None, 1e-3)
    (grad,) = torch.autograd.grad(loss, logits)
    reference_logits = logits.detach().clone().requires_grad_()
    reference = moe_utils.z_loss_func(reference_logits, 1e-3)
    (reference_grad,) = torch.autograd.grad(reference, reference_logits)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(grad, reference_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_load_balancing_loss_matches_megatron(score_function, top_k):
    _, moe_utils = _megatron()
    logits = _logits().requires_grad_()
    scores, selected = aux_loss_scores(logits, top_k=top_k, score_function=score_function)
    loss = load_balancing_loss(scores, selected, None, top_k=top_k, coeff=1e-2)
    (grad,) = torch.autograd.grad(loss, logits)

    reference_logits = logits.detach().clone().requires_grad_()
    reference_map, reference_scores = moe_utils.compute_routing_scores_for_aux_loss(
        reference_logits, top_k, score_function
    )
    reference = moe_utils.switch_load_balancing_loss_func(
        probs=reference_scores,
        tokens_per_expert=reference_map.sum(dim=0),
        total_num_tokens=NUM_ROWS,
        topk=top_k,
        num_experts=NUM_EXPERTS,
        moe_aux_loss_coeff=1e-2,
    )
    (reference_grad,) = torch.autograd.grad(reference, reference_logits)
    assert torch.equal(selected, reference_map)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(grad, reference_grad, rtol=1e-5, atol=1e-10)


@pytest.fixture
def single_process_all_reduce(monkeypatch):
    """megatron's bias update all-reduces the counts; over one process that is the identity."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(_megatron()[0], "get_tensor_and_data_parallel_group", lambda **_: None)


@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "three-layers"])
def test_expert_bias_update_matches_megatron(single_process_all_reduce, stacked):
    _, moe_utils = _megatron()
    generator = torch.Generator().manual_seed(42)
    layers = 3 if stacked else 1
    biases = torch.randn(layers, NUM_EXPERTS, generator=generator) * 0.1
    counts = []
    for layer in range(layers):
        logits = _logits(seed=layer)
        routing = topk_routing(logits, top_k=2, score_function="sigmoid", expert_bias_E=biases[layer])
        _, reference_map = moe_utils.topk_routing_with_score_function(
            logits, 2, score_function="sigmoid", expert_bias=biases[layer]
        )
        counts.append(expert_assignment_counts(routing.experts_NK, None, NUM_EXPERTS))
        assert torch.equal(counts[-1], reference_map.sum(dim=0).float())
    counts = torch.stack(counts)
    if not stacked:
        counts, biases = counts[0], biases[0]
    expected = moe_utils.get_updated_expert_bias(counts.clone(), biases, 1e-3)
    updated = updated_expert_bias(counts, biases, 1e-3)
    assert torch.equal(updated, expected)
    assert not torch.equal(updated, biases)


MODULES = {
    # id: MoEConfig overrides
    "softmax-shared": dict(score_function="softmax", shared_expert_hidden_size=16),
    "softmax-pre-k1": dict(score_function="softmax", top_k=1, softmax_before_topk=True),
    "sigmoid-bias-scaled": dict(score_function="sigmoid", expert_bias=True, topk_scaling_factor=2.5),
    "softmax-gated-shared": dict(score_function="softmax", shared_expert_hidden_size=16, shared_expert_gate=True),
    # BailingHybrid's MoE: group-limited routing, SwiGLU clipped in the routed and the shared experts
    # (on these rows the limits clip 12% (routed) and 21% (shared) of the SiLU values, 39% and 54% of the up values)
    "bailing-groups-clipped": dict(score_function="sigmoid", expert_bias=True, topk_scaling_factor=2.5, top_k=3,
                                   num_groups=4, topk_groups=2, shared_expert_hidden_size=16, swiglu_limit=1.0,
                                   shared_swiglu_limit=0.7),
}


def _module(overrides, dtype=torch.float64, backend="loop", seed=42):
    config = MoEConfig(
        hidden_size=16, num_experts=NUM_EXPERTS, top_k=overrides.get("top_k", 2), expert_hidden_size=8,
        aux_loss_coeff=1e-2, z_loss_coeff=1e-3, experts_backend=backend, init_std=0.3,
        **{k: v for k, v in overrides.items() if k != "top_k"},
    )
    torch.manual_seed(seed)
    module = MoE(config).to(dtype)
    if module.expert_bias is not None:
        module.expert_bias.copy_(torch.randn(NUM_EXPERTS) * 0.2)
    return module


def _random_compact_map(num_compact, num_semantic, seed=42):
    generator = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, num_compact, (num_semantic - num_compact,), generator=generator)
    compact_map = torch.cat([torch.arange(num_compact), extra])
    return compact_map[torch.randperm(num_semantic, generator=generator)]


def _run(module, x, multiplicity, compact_map, upstream_SD):
    """Forward, loss Σ upstream·y[m] + aux, backward; returns outputs, aux and every gradient."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    y, aux = module(x, multiplicity)
    y_S = y if compact_map is None else y[compact_map]
    ((y_S * upstream_SD).sum() + aux.loss).backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return y_S.detach(), aux, x.grad, grads


@pytest.mark.parametrize("name", MODULES)
def test_compact_q_weighted_equals_expanded(name):
    _, moe_utils = _megatron()
    module = _module(MODULES[name])
    num_compact, num_semantic = 40, 150
    compact_map = _random_compact_map(num_compact, num_semantic)
    multiplicity = torch.bincount(compact_map, minlength=num_compact)
    generator = torch.Generator().manual_seed(42)
    x_CD = torch.randn(num_compact, 16, generator=generator, dtype=torch.float64)
    upstream_SD = torch.randn(num_semantic, 16, generator=generator, dtype=torch.float64)

    y, aux, grad_x, grads = _run(module, x_CD, multiplicity, compact_map, upstream_SD)
    y_ref, aux_ref, grad_x_S, grads_ref = _run(module, x_CD[compact_map], None, None, upstream_SD)

    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    assert aux.z_loss.item() == pytest.approx(aux_ref.z_loss.item(), rel=1e-12)
    assert aux.load_balancing_loss.item() == pytest.approx(aux_ref.load_balancing_loss.item(), rel=1e-12)
    assert torch.equal(aux.tokens_per_expert_E, aux_ref.tokens_per_expert_E)
    assert float(aux.tokens_per_expert_E.sum()) == num_semantic * module.config.top_k
    grad_x_ref = torch.zeros_like(grad_x).index_add_(0, compact_map, grad_x_S)
    assert torch.allclose(grad_x, grad_x_ref, rtol=0, atol=1e-12)
    for parameter in grads:
        scale = float(grads_ref[parameter].abs().max())
        assert float((grads[parameter] - grads_ref[parameter]).abs().max()) <= 1e-10 * scale, parameter

    # The expanded rows are plain megatron rows: the q-weighted compact losses equal megatron's
    # (to fp32 precision: megatron's softmax scores are fp32 even for fp64 logits).
    logits_S = module.router_logits(x_CD[compact_map]).detach()
    assert aux.z_loss.item() == pytest.approx(moe_utils.z_loss_func(logits_S, 1e-3).item(), rel=1e-12)
    top_k, score_function = module.config.top_k, module.config.score_function
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits_S, top_k, score_function)
    megatron_balance = moe_utils.switch_load_balancing_loss_func(
        scores, routing_map.sum(dim=0), num_semantic, top_k, NUM_EXPERTS, 1e-2
    )
    assert aux.load_balancing_loss.item() == pytest.approx(megatron_balance.item(), rel=1e-6)


@pytest.mark.parametrize("name", MODULES)
def test_step_shares_add_up_to_one_forward(name):
    """Rows split into three forwards (compact rows with multiplicities): the forwards' `step_share`s, with the
    step's tokens and summed load-balancing counts, add up to the MoE losses of all rows in one forward, value and
    every gradient (fp64). Not their plain sum, nor their mean: both differ."""
    module = _module(MODULES[name])
    generator = torch.Generator().manual_seed(7)
    num_rows = 60
    x = torch.randn(num_rows, 16, generator=generator, dtype=torch.float64)
    multiplicity = torch.randint(1, 5, (num_rows,), generator=generator)
    pieces = [slice(0, 10), slice(10, 35), slice(35, 60)]

    module.zero_grad()
    _, whole = module(x, multiplicity)
    whole.loss.backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    module.zero_grad()
    auxes = [module(x[piece], multiplicity[piece])[1] for piece in pieces]
    step_tokens = float(multiplicity.sum())
    counts = sum(aux.balance_counts_E for aux in auxes)
    shares = [step_share(aux, module.config, step_tokens=step_tokens, step_balance_counts_E=counts) for aux in auxes]
    total = sum(shares)
    total.backward()
    got = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    assert float(total) == pytest.approx(float(whole.loss), rel=1e-12)
    assert got.keys() == want.keys() == {"router_weight"}
    for n in want:
        assert float((got[n] - want[n]).abs().max()) <= 1e-12 * float(want[n].abs().max()), n
    naive = sum(float(aux.loss) for aux in auxes)
    assert abs(naive - float(whole.loss)) > 1e-3 * float(whole.loss)
    assert abs(naive / len(auxes) - float(whole.loss)) > 1e-3 * float(whole.loss)


def _grouped_mm_runs_on_cpu():
    try:
        torch._grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 8), offs=torch.tensor([1, 4], dtype=torch.int32))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _grouped_mm_runs_on_cpu(), reason="torch._grouped_mm has no CPU kernel in this torch")
@pytest.mark.parametrize("backend", ["grouped", "lean"])
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("num_rows", [1, 5, 63], ids=lambda n: f"rows{n}")
def test_grouped_equals_loop_cpu(name, num_rows, backend):
    loop = _module(MODULES[name], dtype=torch.float32, backend="loop")
    grouped = _module(MODULES[name], dtype=torch.float32, backend=backend)
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(num_rows, 16, generator=generator)
    upstream = torch.randn(num_rows, 16, generator=generator)
    y, aux, grad_x, grads = _run(grouped, x, None, None, upstream)
    y_ref, aux_ref, grad_x_ref, grads_ref = _run(loop, x, None, None, upstream)
    if num_rows == 5:
        assert (aux.tokens_per_expert_E == 0).any()  # empty groups are exercised
    # fp32 rounding in another order (lean moves the combine weight onto the activation): errors
    # relative to each tensor's largest entry.
    pairs = {"y": (y, y_ref), "grad_x": (grad_x, grad_x_ref)} | {p: (grads[p], grads_ref[p]) for p in grads}
    for quantity, (got, expected) in pairs.items():
        assert float((got - expected).abs().max()) <= 2e-6 * float(expected.abs().max()), quantity


def _saved_bytes(module, x):
    """Bytes of the distinct tensors autograd keeps for the backward of one forward."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x.detach().clone().requires_grad_())
    return sum(storages.values())


@pytest.mark.skipif(not _grouped_mm_runs_on_cpu(), reason="torch._grouped_mm has no CPU kernel in this torch")
def test_lean_forward_is_grouped_and_keeps_less():
    """The lean node's forward is the grouped path's bit for bit, and it keeps at least the dispatched rows
    and the permuted expert outputs (two [R, D] tensors) less for the backward."""
    overrides = dict(MODULES["sigmoid-bias-scaled"], top_k=4)
    grouped = _module(overrides, dtype=torch.float32, backend="grouped")
    lean = _module(overrides, dtype=torch.float32, backend="lean")
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(42))
    assert torch.equal(lean(x)[0], grouped(x)[0])
    routed_rows_bytes = 256 * 4 * 16 * 4
    assert _saved_bytes(grouped, x) - _saved_bytes(lean, x) >= 2 * routed_rows_bytes


def _lean_composed(module, x):
    """The lean experts in the combine dtype, then the shared expert added and the sum cast to x's dtype: what the
    lean node computes in one piece."""
    routing = module.route(module.router_logits(x))
    shared = module.shared_expert(x)  # before the experts, as the layer does: x's gradient sums in the same order
    out = module.lean_experts(x, routing)
    return (out + shared.to(out.dtype)).to(x.dtype)


SHARED_MODULES = [name for name in MODULES if MODULES[name].get("shared_expert_hidden_size")]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not _grouped_mm_runs_on_cpu(),
                                                 reason="torch._grouped_mm has no CPU kernel in this torch")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs CUDA")]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", SHARED_MODULES)
def test_lean_adds_the_shared_expert_in_its_combine(name, dtype, device):
    """The lean node adds the shared expert's output in its combine's sum and rounds once to the rows' dtype: the
    output and every gradient are the composed path's (lean experts, + shared, cast) bit for bit (on CUDA in bf16
    the combine kernel's addend)."""
    module = _module(MODULES[name], dtype=dtype, backend="lean").to(device)
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(63, 16, generator=generator).to(device, dtype)
    upstream = torch.randn(63, 16, generator=generator).to(device, dtype)
    results = []
    for run in (lambda x: module(x)[0], lambda x: _lean_composed(module, x)):
        leaves = [x.clone().requires_grad_(), *module.parameters()]
        y = run(leaves[0])
        results.append([y, *torch.autograd.grad((y.float() * upstream.float()).sum(), leaves, allow_unused=True)])
    assert results[0][0].dtype == dtype
    names = ["y", "x", *(n for n, _ in module.named_parameters())]
    for quantity, got, expected in zip(names, *results):
        assert (got is None) == (expected is None), quantity
        assert got is None or torch.equal(got, expected), quantity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [3, 4096], ids=lambda n: f"rows{n}")
def test_lean_equals_grouped_cuda_autocast(num_rows):
    """fp32 parameters under bf16 autocast (the cast operands), with empty expert groups at 3 rows (6 routed
    rows, 8 experts): the lean
    node's forward is the grouped path's bit for bit, its gradients the same function in bf16."""
    device = torch.device("cuda")
    overrides = MODULES["sigmoid-bias-scaled"]
    grouped = _module(overrides, dtype=torch.float32, backend="grouped").to(device)
    lean = _module(overrides, dtype=torch.float32, backend="lean").to(device)
    generator = torch.Generator(device=device).manual_seed(42)
    x = torch.randn(num_rows, 16, generator=generator, device=device)
    upstream = torch.randn(num_rows, 16, generator=generator, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _, grad_x, grads = _run(lean, x, None, None, upstream)
        y_ref, aux_ref, grad_x_ref, grads_ref = _run(grouped, x, None, None, upstream)
    if num_rows == 3:
        assert (aux_ref.tokens_per_expert_E == 0).any()
    assert torch.equal(y, y_ref)
    for got, expected in [(grad_x, grad_x_ref)] + [(grads[p], grads_ref[p]) for p in grads]:
        assert float((got - expected).abs().max()) <= 2e-2 * float(expected.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["grouped", "lean"])
@pytest.mark.parametrize("name", MODULES)
def test_grouped_equals_loop_cuda_bf16(name, backend):
    """GPU path: bf16 grouped GEMMs against the bf16 loop; errors relative to each tensor's scale."""
    device = torch.device("cuda")
    loop = _module(MODULES[name], dtype=torch.bfloat16, backend="loop").to(device)
    grouped = _module(MODULES[name], dtype=torch.bfloat16, backend=backend).to(device)
    generator = torch.Generator(device=device).manual_seed(42)
    x = torch.randn(4096, 16, generator=generator, device=device).bfloat16()
    upstream = torch.randn(4096, 16, generator=generator, device=device).bfloat16()
    y, aux, grad_x, grads = _run(grouped, x, None, None, upstream)
    y_ref, aux_ref, grad_x_ref, grads_ref = _run(loop, x, None, None, upstream)
    assert torch.equal(aux.tokens_per_expert_E, aux_ref.tokens_per_expert_E)
    pairs = [(y, y_ref), (grad_x, grad_x_ref)] + [(grads[p], grads_ref[p]) for p in grads]
    for got, expected in pairs:
        error = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert float(error) <= 2e-2


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("backend", ["loop", "grouped", "lean"])
def test_zero_rows(backend, device):
    """A layer given no rows (an empty shard or microbatch) returns no rows, losses of 0 and zero counts, and runs
    backward: the losses are sums over no rows, not 0/0. On CUDA the grouped and lean paths launch their kernels
    over no rows."""
    if device == "cpu" and backend != "loop" and not _grouped_mm_runs_on_cpu():
        pytest.skip("torch._grouped_mm has no CPU kernel in this torch")
    torch.manual_seed(0)
    config = dataclasses.replace(load_model_config("tiny").moe, experts_backend=backend, z_loss_coeff=1e-3)
    moe = MoE(config).to(device)
    x = torch.zeros(0, config.hidden_size, device=device, requires_grad=True)
    out, aux = moe(x)
    (out.sum() + aux.loss).backward()
    assert out.shape == (0, config.hidden_size)
    assert aux.z_loss.item() == 0 and aux.load_balancing_loss.item() == 0 and aux.loss.item() == 0
    assert aux.tokens_per_expert_E.sum().item() == 0
    assert all(p.grad is None or not p.grad.any() for p in moe.parameters())


def test_update_expert_bias_in_place():
    module = _module(MODULES["sigmoid-bias-scaled"], dtype=torch.float32)
    before = module.expert_bias.clone()
    counts = torch.arange(NUM_EXPERTS, dtype=torch.float32)
    module.update_expert_bias(counts)
    step = torch.sign(counts.mean() - counts) * module.config.bias_update_rate
    assert torch.equal(module.expert_bias, before + step)
    with pytest.raises(ValueError, match="no expert bias"):
        _module(MODULES["softmax-shared"]).update_expert_bias(counts)


def test_expert_bias_stays_fp32_under_module_casts():
    module = _module(MODULES["sigmoid-bias-scaled"], dtype=torch.float32)
    module.expert_bias.add_(1e-4)
    before = module.expert_bias.clone()
    module = module.to(torch.bfloat16)
    assert module.router_weight.dtype == torch.bfloat16
    assert module.expert_bias.dtype == torch.float32 and torch.equal(module.expert_bias, before)
    assert "expert_bias" in module.state_dict()


def test_disabled_losses_are_absent():
    module = _module(dict(score_function="softmax"), dtype=torch.float32)
    module.config = dataclasses.replace(module.config, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    _, aux = module(torch.randn(6, 16))
    assert aux.z_loss is None and aux.load_balancing_loss is None and aux.loss.item() == 0.0


@pytest.mark.parametrize(
    "overrides",
    [
        dict(top_k=9),
        dict(score_function="relu"),
        dict(expert_bias=True),
        dict(top_k=1),
        dict(experts_backend="fast"),
        dict(z_loss_coeff=-1.0),
        dict(shared_expert_gate=True),
        dict(num_groups=2, topk_groups=1),
        dict(score_function="sigmoid", num_groups=3),
        dict(score_function="sigmoid", num_groups=8),
        dict(score_function="sigmoid", num_groups=2, topk_groups=3),
        dict(score_function="sigmoid", top_k=5, num_groups=4, topk_groups=2),
        dict(swiglu_limit=0.0),
        dict(shared_swiglu_limit=float("inf")),
    ],
    ids=["topk-above-experts", "unknown-score", "bias-with-softmax", "softmax-after-top1", "unknown-backend",
         "negative-coeff", "gate-without-shared-expert", "groups-with-softmax", "groups-not-dividing",
         "groups-of-one", "topk-groups-above-groups", "topk-above-group-experts", "zero-limit",
         "infinite-shared-limit"],
)
def test_bad_configs(overrides):
    base = dict(hidden_size=16, num_experts=8, top_k=2, expert_hidden_size=8)
    with pytest.raises(ValueError, match="MoEConfig"):
        MoEConfig(**{**base, **overrides})


@pytest.mark.parametrize("case", ["wrong-width", "wrong-multiplicity"])
def test_bad_inputs(case):
    module = _module(MODULES["softmax-shared"], dtype=torch.float32)
    x = torch.randn(5, 15 if case == "wrong-width" else 16)
    multiplicity = torch.ones(4) if case == "wrong-multiplicity" else None
    with pytest.raises(ValueError, match="MoE"):
        module(x, multiplicity)


@pytest.mark.parametrize("multiplicity", [False, True], ids=["no-q", "q"])
def test_counts_and_token_total_stay_exact_under_bf16_autocast(multiplicity):
    """Under bf16 autocast the router logits are bf16; the token total, the balance counts and the reductions of the
    losses they normalise still run in fp32: 1,001 rows (bf16 would round the total to 1,000) with q up to 300."""
    module = _module({**MODULES["softmax-shared"], "balance_statistics": True}, dtype=torch.float32)
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(1001, 16, generator=generator)
    q = torch.randint(1, 301, (1001,), generator=generator) if multiplicity else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, aux = module(x, q)
        logits = module.router_logits(x)
        scores, selected = aux_loss_scores(logits, top_k=2, score_function="softmax")
        squared_lse = torch.logsumexp(logits, dim=-1).square()
    total = 1001.0 if q is None else float(q.sum())
    assert aux.num_tokens.dtype == torch.float32 and aux.num_tokens.item() == total
    assert aux.balance_counts_E.dtype == torch.float32 and aux.balance_counts_E.sum().item() == total * 2
    # The losses from the same autocast logits and scores, every reduction in fp64.
    q64 = torch.ones(1001, dtype=torch.float64) if q is None else q.double()
    mass, counts = (q64[:, None] * scores.double()).sum(0), (q64[:, None] * selected.double()).sum(0)
    balance = (mass * counts).sum() * NUM_EXPERTS / 2 / total**2 * 1e-2
    z_loss = (q64 * squared_lse.double()).sum() / total * 1e-3
    assert aux.load_balancing_loss.item() == pytest.approx(balance.item(), rel=1e-5)
    assert aux.z_loss.item() == pytest.approx(z_loss.item(), rel=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_router_logits_equal_the_cast_expression(dtype, autocast):
    """The router node keeps the rows in their dtype but computes and differentiates exactly
    `x.to(fp32) @ w.to(fp32).T` (under bf16 autocast too, where that product runs in bf16)."""
    if autocast and dtype == torch.float64:
        pytest.skip("autocast leaves fp64 alone")
    module = _module(MODULES["softmax-shared"], dtype=dtype)
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(33, 16, generator=generator).to(dtype)
    upstream = torch.randn(33, NUM_EXPERTS, generator=generator, dtype=torch.float64)
    results = []
    for run in (module.router_logits,
                lambda rows: rows.to(torch.promote_types(dtype, torch.float32))
                @ module.router_weight.to(torch.promote_types(dtype, torch.float32)).T):
        rows = x.clone().requires_grad_()
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = run(rows)
        (logits * upstream.to(logits.dtype)).sum().backward()
        results.append((logits.detach(), rows.grad, module.router_weight.grad.clone()))
    for got, expected in zip(*results):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_router_keeps_the_narrowest_rows(dtype):
    """Under bf16 autocast the router node keeps bf16 rows for the backward, whatever the rows' dtype (the plain
    expression kept autocast's bf16 copy; the fp32 rows themselves would be twice that)."""
    module = _module(MODULES["softmax-shared"], dtype=dtype)
    x = torch.randn(33, 16, generator=torch.Generator().manual_seed(42)).to(dtype).requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module.router_logits(x)
    rows = [t for t in kept if t.shape == x.shape]
    assert len(rows) == 1 and rows[0].dtype == torch.bfloat16


def test_a_model_switches_its_experts_backend_on_the_same_weights():
    """`HybridModel.set_experts_backend`: every MoE layer and the model's config run the new backend; the
    parameters are untouched; an unknown backend is refused and changes nothing."""
    from harts.model.model import HybridModel
    from harts.model.moe import MoE

    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=0)
    before = {name: p.clone() for name, p in model.named_parameters()}
    model.set_experts_backend("lean")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and {m.config.experts_backend for m in layers} == {"lean"}
    assert model.config.moe.experts_backend == "lean"
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    with pytest.raises(ValueError, match="experts_backend must be one of"):
        model.set_experts_backend("fast")
    assert {m.config.experts_backend for m in layers} == {"lean"} and model.config.moe.experts_backend == "lean"


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalised", "unnormalised"])
def test_gated_shared_expert_and_routing_match_qwen3_next(norm_topk_prob):
    """Qwen3-Next's sparse MoE block (transformers: softmax over all experts, top-k, renormalised when
    norm_topk_prob, plus sigmoid(shared_expert_gate(x)) · shared_expert(x)) on the same weights: HARTS's softmax
    routing after top-k (normalised), or with softmax_before_topk (not), and the gated shared expert."""
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hf_config = transformers.Qwen3NextConfig(hidden_size=16, num_experts=NUM_EXPERTS, num_experts_per_tok=3,
                                             moe_intermediate_size=8, shared_expert_intermediate_size=12,
                                             norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    block = Qwen3NextSparseMoeBlock(hf_config).double()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, dtype=torch.float64) * 0.4)
    module = _module(dict(score_function="softmax", top_k=3, shared_expert_hidden_size=12, shared_expert_gate=True,
                          softmax_before_topk=not norm_topk_prob))
    with torch.no_grad():
        module.router_weight.copy_(block.gate.weight)
        module.gate_up_proj.copy_(block.experts.gate_up_proj.transpose(1, 2))
        module.down_proj.copy_(block.experts.down_proj.transpose(1, 2))
        shared = block.shared_expert
        module.shared_gate_up_proj.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).T)
        module.shared_down_proj.copy_(shared.down_proj.weight.T)
        module.shared_gate_weight.copy_(block.shared_expert_gate.weight)
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = block(x).reshape(18, 16)
    y, _ = module(x.reshape(18, 16))
    # transformers takes the softmax in fp32 (dtype=torch.float) whatever the rows' dtype: fp32 rounding.
    assert float((y - expected).abs().max()) <= 1e-6 * float(expected.abs().max())


def _naive_group_limited(logits_NE, bias_E, *, top_k, num_groups, topk_groups, scaling):
    """Row by row in Python: the groups ranked by the sum of their two best biased sigmoid scores, the k best
    biased scores among the experts of the `topk_groups` best groups, their unbiased scores normalised and scaled.
    Returns {row: {expert: weight}}."""
    scores = torch.sigmoid(logits_NE.double())
    selection = scores + bias_E.double()
    size = logits_NE.shape[1] // num_groups
    chosen = {}
    for row in range(logits_NE.shape[0]):
        values = selection[row].tolist()
        group_score = [sum(sorted(values[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(num_groups)]
        groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        candidates = [e for g in groups for e in range(g * size, (g + 1) * size)]
        experts = sorted(candidates, key=lambda e: -values[e])[:top_k]
        total = sum(float(scores[row, e]) for e in experts)
        chosen[row] = {e: float(scores[row, e]) / total * scaling for e in experts}
    return chosen


def _as_dict(experts_NK, probs_NK):
    return {row: dict(zip(experts_NK[row].tolist(), probs_NK[row].double().tolist()))
            for row in range(experts_NK.shape[0])}


def test_group_limited_routing_matches_naive_reference():
    """64 experts in 8 groups, top-8 among the 4 best groups (Ling-3's shape): the selected experts and their
    weights are the row-by-row reference's, and the group limit changes the selection of most rows."""
    generator = torch.Generator().manual_seed(42)
    logits = torch.randn(50, 64, generator=generator) * 2
    bias = torch.randn(64, generator=generator) * 0.3
    routing = topk_routing(logits, top_k=8, score_function="sigmoid", expert_bias_E=bias, topk_scaling_factor=2.5,
                           num_groups=8, topk_groups=4)
    expected = _naive_group_limited(logits, bias, top_k=8, num_groups=8, topk_groups=4, scaling=2.5)
    actual = _as_dict(routing.experts_NK, routing.probs_NK)
    assert actual.keys() == expected.keys()
    for row in expected:
        assert actual[row].keys() == expected[row].keys(), row
        for expert, weight in expected[row].items():
            assert actual[row][expert] == pytest.approx(weight, rel=1e-6), (row, expert)
    free = topk_routing(logits, top_k=8, score_function="sigmoid", expert_bias_E=bias, num_groups=1)
    changed = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(routing.experts_NK, free.experts_NK))
    assert changed > 25


def test_group_limited_routing_matches_transformers_bailing_router():
    """transformers' `BailingHybridTopkRouter` (n_group, topk_group, routed_scaling_factor, norm_topk_prob, its
    e_score_correction_bias) on the same rows and weights: the same experts and weights."""
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridTopkRouter

    config = transformers_bailing_config(num_local_experts=32, num_experts_per_tok=6, n_group=4, topk_group=2,
                                         routed_scaling_factor=2.5, hidden_size=24)
    router = BailingHybridTopkRouter(config)
    generator = torch.Generator().manual_seed(42)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 24, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=generator) * 0.3)
    x = torch.randn(40, 24, generator=generator)
    with torch.no_grad():
        logits, weights, indices = router(x)
    routing = topk_routing(x @ router.weight.T, top_k=6, score_function="sigmoid",
                           expert_bias_E=router.e_score_correction_bias, topk_scaling_factor=2.5, num_groups=4,
                           topk_groups=2)
    actual, expected = _as_dict(routing.experts_NK, routing.probs_NK), _as_dict(indices, weights)
    for row in expected:
        assert actual[row].keys() == expected[row].keys(), row
        for expert, weight in expected[row].items():
            assert actual[row][expert] == pytest.approx(weight, rel=1e-6), (row, expert)


def transformers_bailing_config(**changes):
    """A small transformers `BailingHybridConfig` (no MTP layers, no token ids)."""
    import transformers

    settings = dict(vocab_size=64, hidden_size=24, intermediate_size=32, moe_intermediate_size=8,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=8, layer_group_size=2,
                    first_k_dense_replace=0, num_mtp_layers=0, pad_token_id=None, eos_token_id=None)
    settings.update(changes)
    return transformers.BailingHybridConfig(**settings)


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_clipped_experts_match_transformers_bailing_mlp(shared):
    """One clipped expert against transformers' on the same weights (fp64): routed, `BailingHybridExperts` with its
    layer's `swiglu_limits` (every row routed to expert 0 with weight 1) against the loop path; shared,
    `BailingHybridMLP` with `swiglu_limits_shared` against `MoE.shared_expert`. Without the limits they differ."""
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridExperts, BailingHybridMLP

    from harts.model.moe import Routing

    config = transformers_bailing_config(num_local_experts=4, num_experts_per_tok=1, swiglu_limits=[0.0, 0.6],
                                         swiglu_limits_shared=[0.0, 0.4])
    ours = MoE(MoEConfig(hidden_size=24, num_experts=4, top_k=1, expert_hidden_size=8, score_function="sigmoid",
                         shared_expert_hidden_size=8, swiglu_limit=0.6, shared_swiglu_limit=0.4)).double()
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(30, 24, generator=generator, dtype=torch.float64)
    gate_up = torch.randn(24, 16, generator=generator, dtype=torch.float64)
    down = torch.randn(8, 24, generator=generator, dtype=torch.float64)
    routing = Routing(experts_NK=torch.zeros(30, 1, dtype=torch.long), probs_NK=torch.ones(30, 1, dtype=torch.float64))
    with torch.no_grad():
        if shared:
            theirs = BailingHybridMLP(config, intermediate_size=8, layer_idx=1).double()
            theirs.gate_proj.weight.copy_(gate_up[:, :8].T)
            theirs.up_proj.weight.copy_(gate_up[:, 8:].T)
            theirs.down_proj.weight.copy_(down.T)
            ours.shared_gate_up_proj.copy_(gate_up)
            ours.shared_down_proj.copy_(down)
            expected = theirs(x)
        else:
            theirs = BailingHybridExperts(config, layer_idx=1).double()
            theirs.gate_up_proj[0].copy_(gate_up.T)
            theirs.down_proj[0].copy_(down.T)
            ours.gate_up_proj[0].copy_(gate_up)
            ours.down_proj[0].copy_(down)
            expected = theirs(x, routing.experts_NK, routing.probs_NK)

        def run(module):
            return module.shared_expert(x) if shared else module.loop_experts(x, routing)

        torch.testing.assert_close(run(ours), expected, rtol=1e-12, atol=1e-12)
        ours.config = dataclasses.replace(ours.config, swiglu_limit=None, shared_swiglu_limit=None)
        assert not torch.allclose(run(ours), expected)


def test_model_layers_get_their_own_swiglu_limits():
    """`ModelConfig.moe_for_layer`: each MoE layer carries its entry of the per-layer lists (0: none), also after
    `set_experts_backend`; without lists every layer shares the model's MoE config."""
    from harts.model.model import HybridModel
    from harts.model.moe import MoE

    config = load_model_config("tiny")
    assert config.moe_for_layer(2) is config.moe
    config = dataclasses.replace(config, expert_swiglu_limits=[0, 0, 3.0, 5.0],
                                 shared_expert_swiglu_limits=[0, 0, 0, 7.0])
    model = HybridModel(config)
    model.set_experts_backend("loop")
    limits = [(m.config.swiglu_limit, m.config.shared_swiglu_limit) for m in model.modules() if isinstance(m, MoE)]
    assert limits == [(None, None), (3.0, None), (5.0, 7.0)]
    with pytest.raises(ValueError, match="model.expert_swiglu_limits must list 4 finite numbers"):
        dataclasses.replace(config, expert_swiglu_limits=[0, 1.0])
