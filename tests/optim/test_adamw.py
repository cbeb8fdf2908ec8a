import math

import pytest
import torch
from torch import nn

from harts.optim.adamw import Fp32Gradients, MasterWeightAdamW, lr_factor, make_scheduler
from harts.optim.config import OptimizerConfig, ScheduleConfig


def _plain_model(seed: int = 42, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False)).to(dtype)


def _backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 5, generator=generator).to(next(model.parameters()).dtype)
    (model(x).float() ** 2).sum().backward()


def test_adamw_matches_torch_on_a_plain_model():
    # Five steps of warm-up + cosine, weight decay on matrices only, clipping that is active on
    # some steps: the same as torch's AdamW with those two groups, LambdaLR and clip_grad_norm_.
    config = OptimizerConfig(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.1, max_grad_norm=20.0)
    schedule = ScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    ours, reference = _plain_model(), _plain_model()
    optimizer = MasterWeightAdamW(ours.named_parameters(), config)
    scheduler = make_scheduler(optimizer, schedule, num_steps=5)
    matrices = [p for p in reference.parameters() if p.dim() >= 2]
    vectors = [p for p in reference.parameters() if p.dim() < 2]
    torch_adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                                    lr=0.05, betas=(0.8, 0.95), eps=1e-7)
    factors = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)), 0.1 + 0.9 * 0.5 * (1 + math.cos(2 * math.pi / 3))]
    clipped = 0
    for step in range(5):
        optimizer.zero_grad()
        torch_adamw.zero_grad()
        _backward(ours, step)
        _backward(reference, step)
        norm = optimizer.clip_grad_norm(config.max_grad_norm)
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 20.0)
        assert norm == float(reference_norm)
        clipped += norm > 20.0
        for group in torch_adamw.param_groups:
            group["lr"] = 0.05 * factors[step]
        assert scheduler.get_last_lr() == [0.05 * factors[step]] * 2
        optimizer.step()
        scheduler.step()
        torch_adamw.step()
        for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
            assert torch.equal(a, b), (step, name)
    assert 0 < clipped < 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-masters"])
def test_pending_state_bytes_are_the_moments_not_yet_allocated(dtype):
    """Before a master's first step its two fp32 moments are still to come (what a memory search before the first
    step must leave room for); a master without a gradient at a step stays pending; after every one has stepped,
    none."""
    model = _plain_model(dtype=dtype)
    optimizer = MasterWeightAdamW(model.named_parameters(), OptimizerConfig(lr=0.1))
    assert optimizer.pending_state_bytes() == 2 * 4 * sum(p.numel() for p in model.parameters())
    _backward(model, 0)
    skipped = optimizer.masters[1]
    skipped.grad = None  # torch's AdamW skips a master without a gradient: its moments stay unallocated
    optimizer.step()
    assert optimizer.pending_state_bytes() == 2 * 4 * skipped.numel()
    optimizer.zero_grad()
    _backward(model, 1)
    optimizer.step()
    assert optimizer.pending_state_bytes() == 0


@pytest.mark.parametrize("decay_vectors", [False, True], ids=["matrices-only", "vectors-too"])
def test_weight_decay_groups(decay_vectors):
    model = _plain_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = OptimizerConfig(lr=0.1, weight_decay=0.5, weight_decay_vectors=decay_vectors)
    optimizer = MasterWeightAdamW(model.named_parameters(), config)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: AdamW's update is the decay alone
    optimizer.step()
    for name, p in model.named_parameters():
        decayed = p.dim() >= 2 or decay_vectors
        expected = before[name] * (1 - 0.1 * 0.5) if decayed else before[name]
        assert torch.equal(p.detach(), expected), name


def test_master_weights_keep_fp32_precision():
    # bf16 weights of 1.0 with updates of 1e-4 (below half a bf16 ulp, 2^-8): the fp32 masters equal an
    # fp32 AdamW fed the same gradients bit for bit, and the bf16 weights are the masters rounded; a
    # bf16 AdamW without masters never moves.
    steps, lr = 40, 1e-4
    config = OptimizerConfig(lr=lr, weight_decay=0.0, max_grad_norm=0.0)
    bf16 = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    fp32 = nn.Linear(4, 4, bias=False)
    plain = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    for layer in (bf16, fp32, plain):
        nn.init.ones_(layer.weight)
    optimizer = MasterWeightAdamW(bf16.named_parameters(), config)
    reference = torch.optim.AdamW(fp32.parameters(), lr=lr, weight_decay=0.0)
    naive = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        optimizer.zero_grad()
        gradient = torch.full((4, 4), 0.3).to(torch.bfloat16)
        bf16.weight.grad = gradient.clone()
        optimizer.masters[0].grad = gradient.float()  # what the accumulation hook gives (tested below)
        fp32.weight.grad = gradient.float()
        plain.weight.grad = gradient.clone()
        optimizer.step()
        reference.step()
        naive.step()
    (master,) = optimizer.masters
    assert master.dtype == torch.float32
    assert torch.equal(master, fp32.weight.detach())
    assert torch.equal(bf16.weight.detach(), master.to(torch.bfloat16))
    assert float(master[0, 0]) == pytest.approx(1 - steps * lr, rel=1e-4)
    assert float(bf16.weight.detach()[0, 0]) < 1.0
    assert torch.equal(plain.weight.detach(), torch.ones(4, 4, dtype=torch.bfloat16))


def test_bf16_gradients_accumulate_in_fp32():
    # Two microbatch backwards giving 1 and 2^-9: their bf16 sum is 1 (the small one is lost), the
    # masters' fp32 sum keeps it; the bf16 .grad is freed after each backward.
    layer = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    nn.init.ones_(layer.weight)
    optimizer = MasterWeightAdamW(layer.named_parameters(), OptimizerConfig())
    for scale in (1.0, 2.0 ** -9):
        layer(torch.full((1, 1), scale, dtype=torch.bfloat16)).sum().backward()
        assert layer.weight.grad is None
    (master,) = optimizer.masters
    assert master.grad.dtype == torch.float32
    assert float(master.grad) == 1.0 + 2.0 ** -9
    optimizer.zero_grad()
    assert master.grad is None
    optimizer.remove_hooks()
    layer(torch.ones(1, 1, dtype=torch.bfloat16)).sum().backward()
    assert master.grad is None and layer.weight.grad is not None


def test_fp32_gradients_of_bf16_parameters_without_an_optimizer():
    # As above, for the benchmarks' fp32 gradient buffers: fp32 parameters keep their own .grad.
    model = nn.ModuleDict({"low": nn.Linear(1, 1, bias=False).to(torch.bfloat16), "full": nn.Linear(1, 1, bias=False)})
    nn.init.ones_(model["low"].weight)
    nn.init.ones_(model["full"].weight)

    def backward(scale):
        x = torch.full((1, 1), scale)
        (model["low"](x.to(torch.bfloat16)).float().sum() + model["full"](x).sum()).backward()

    gradients = Fp32Gradients(model.named_parameters())
    assert set(gradients.grads) == {"low.weight"}
    for scale in (1.0, 2.0 ** -9):
        backward(scale)
    assert model["low"].weight.grad is None
    grad = gradients.grads["low.weight"]
    assert grad.dtype == torch.float32 and float(grad) == 1.0 + 2.0 ** -9
    assert float(model["full"].weight.grad) == 1.0 + 2.0 ** -9
    gradients.remove()
    backward(1.0)
    assert model["low"].weight.grad is not None and float(gradients.grads["low.weight"]) == 1.0 + 2.0 ** -9


@pytest.mark.parametrize(
    ("schedule", "num_steps", "expected"),
    [
        (ScheduleConfig(), 4, [1.0, 1.0, 1.0, 1.0]),
        (ScheduleConfig(warmup_steps=4), 6, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
        (ScheduleConfig(decay="cosine"), 4, [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 - math.cos(math.pi / 4))]),
        (ScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.2), 6,
         [0.5, 1.0, 1.0, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)), 0.6, 0.2 + 0.8 * 0.5 * (1 - math.cos(math.pi / 4))]),
    ],
    ids=["constant", "warmup-constant", "cosine", "warmup-cosine-floor"],
)
def test_schedule_values(schedule, num_steps, expected):
    assert [lr_factor(t, schedule, num_steps) for t in range(num_steps)] == pytest.approx(expected, rel=1e-12)
    # The cosine reaches its floor one past the last step and stays there.
    assert lr_factor(num_steps, schedule, num_steps) == pytest.approx(
        schedule.min_lr_ratio if schedule.decay == "cosine" else 1.0)
    assert lr_factor(num_steps + 5, schedule, num_steps) == lr_factor(num_steps, schedule, num_steps)


def test_clip_grad_norm_reports_the_norm_before_clipping():
    model = _plain_model()
    optimizer = MasterWeightAdamW(model.named_parameters(), OptimizerConfig())
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    count = sum(p.numel() for p in model.parameters())
    expected = math.sqrt(count * 0.25)
    assert optimizer.clip_grad_norm(max_norm=0.0) == pytest.approx(expected, rel=1e-6)  # 0: report only
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert optimizer.clip_grad_norm(max_norm=2 * expected) == pytest.approx(expected, rel=1e-6)  # under: unchanged
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert optimizer.clip_grad_norm(max_norm=1.0) == pytest.approx(expected, rel=1e-6)
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float(after) == pytest.approx(1.0, rel=1e-5)
    # Every gradient scaled by the same factor (a global norm, not per parameter).
    assert all(torch.allclose(p.grad, torch.full_like(p, 0.5 / expected), rtol=1e-5) for p in model.parameters())
