"""harts/api.py: an RL batch through HARTS equals each of its sequences run alone through the model.

The reference is independent of the API: every sequence is cut out of the batch by the test's own
bookkeeping, run alone (its own one-trajectory baseline layout), its full S×V logits divided by T,
log_softmax, gathered at the next token and placed where the test put that token. Batches: GRPO
groups (4 prompts × 8 samples, some samples sharing a response prefix, one a duplicate) in verl's
two-sided padding with response-shaped [B, R] fields and [B] advantages, left padding, right
padding, packed and listed; and a batch without sharing. Padding holds a token id outside the
vocabulary and NaN in every float field, and unmasked positions hold NaN too, so a read of either
shows up. fp32 on the CPU: log-probs and entropy within 1e-5 (as tests/model/test_equivalence.py:
the compact rows run the same math in other call shapes), the loss within 1e-6 relative and every
parameter gradient within 1e-4 relative (‖Δg‖ / ‖g‖ per parameter, the equivalence test's bound;
measured: about 1e-6).

Planned mini-batches (`api.plan`, `api.policy_step`): the batch planned into 4+ microbatches (GRPO groups whole,
or every group split) gives the loss, the MoE losses and the gradients of the batch run as one microbatch, on a
model whose MoE loss coefficients (0.5, 0.05) make a misnormalised MoE loss show above the tolerances; without
MoE losses, the per-trajectory oracle's; two replicas add up to the batch.
"""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from harts import api
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.losses import GRPOConfig, PPOConfig, grpo_loss, ppo_loss
from harts.objective.step import StepConfig, run_step, step_normalizer
from harts.objective.targets import semantic_targets_from_step
from harts.runtime.layout import baseline_layout
from harts.trees.step import TOKEN_DTYPE, Step
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture: one intra-op thread, predictable times)

VOCAB = 256
PAD = VOCAB + 7  # never a valid token: reading padding fails the vocabulary check or the comparison


@pytest.fixture(scope="module")
def model():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=42)
    return model


# ---------------------------------------------------------------------------------------------
# Batches


def grpo_sequences(rng, num_prompts=4, samples=8):
    """(prompt, response) pairs: each prompt sampled `samples` times; in each group sample 1 shares
    sample 0's first 5 response tokens and sample 2 repeats sample 0."""
    pairs = []
    for _ in range(num_prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(6, 25))).tolist()
        responses = [rng.integers(0, VOCAB, int(rng.integers(3, 30))).tolist() for _ in range(samples)]
        responses[1] = responses[0][:5] + responses[1]
        responses[2] = list(responses[0])
        pairs += [(prompt, response) for response in responses]
    return pairs


def unshared_sequences(rng, num=6):
    """No two sequences share even their first token: C = S."""
    firsts = rng.choice(VOCAB, num, replace=False)
    return [([int(f), *rng.integers(0, VOCAB, int(rng.integers(2, 10))).tolist()],
             rng.integers(0, VOCAB, int(rng.integers(3, 20))).tolist()) for f in firsts]


def rl_fields(rng, pairs, per_token_advantages):
    """Per-sequence RL data, indexed by token as a target: loss mask on the response, advantages,
    old/ref log-probs (NaN wherever the loss mask is 0: never to be read)."""
    out = []
    for prompt, response in pairs:
        n = len(prompt) + len(response)
        mask = np.zeros(n, dtype=np.int64)
        mask[len(prompt):] = 1

        def masked(values):
            return np.where(mask == 1, values, np.nan)

        advantage = rng.standard_normal()
        out.append(dict(
            loss_mask=mask,
            advantages=masked(rng.standard_normal(n)) if per_token_advantages else advantage,
            old_log_probs=masked(-rng.random(n) * 3 - 2),
            ref_log_probs=masked(-rng.random(n) * 3 - 2),
        ))
    return out


def make_batch(layout, pairs, fields):
    """The batch mapping in `layout` and where each sequence's token i sits in it (flat index)."""
    tokens = [np.asarray(p + r) for p, r in pairs]
    num = len(tokens)
    if layout in ("packed", "trajectories"):
        offsets = np.cumsum([0] + [len(t) for t in tokens])
        places = [np.arange(offsets[b], offsets[b + 1]) for b in range(num)]
        if layout == "trajectories":
            return [dict(input_ids=torch.from_numpy(t), **{k: torch.as_tensor(v) for k, v in f.items()})
                    for t, f in zip(tokens, fields)], places
        batch = dict(input_ids=torch.from_numpy(np.concatenate(tokens)), cu_seqlens=torch.from_numpy(offsets))
        for name in fields[0]:
            if np.ndim(fields[0][name]) == 0:
                batch[name] = torch.tensor([float(f[name]) for f in fields])
            else:
                batch[name] = torch.from_numpy(np.concatenate([f[name] for f in fields]))
        return batch, places
    if layout == "verl":
        # Prompt left-padded to P columns, response right-padded to R columns; per-token fields
        # response-shaped [B, R] (the last R columns), advantages [B].
        width_p = max(len(p) for p, _ in pairs)
        width_r = max(len(r) for _, r in pairs)
        length = width_p + width_r
        starts = [width_p - len(p) for p, _ in pairs]
    else:
        length = max(len(t) for t in tokens) + 3
        starts = [length - len(t) if layout == "left" else 0 for t in tokens]
    input_ids = np.full((num, length), PAD, dtype=np.int64)
    attention = np.zeros((num, length), dtype=np.int64)
    places = []
    for b, t in enumerate(tokens):
        input_ids[b, starts[b]:starts[b] + len(t)] = t
        attention[b, starts[b]:starts[b] + len(t)] = 1
        places.append(b * length + starts[b] + np.arange(len(t)))
    batch = dict(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention))
    for name in fields[0]:
        if np.ndim(fields[0][name]) == 0:
            batch[name] = torch.tensor([float(f[name]) for f in fields])
            continue
        full = np.full((num, length), 0 if name == "loss_mask" else np.nan)
        for b, f in enumerate(fields):
            full.reshape(-1)[places[b]] = f[name]
        if layout == "verl":
            full = full[:, width_p:]
        batch[{"loss_mask": "response_mask", "ref_log_probs": "ref_log_prob"}.get(name, name) if layout == "verl"
              else name] = torch.from_numpy(full.astype(np.int64 if name == "loss_mask" else np.float32))
    return batch, places


# ---------------------------------------------------------------------------------------------
# The per-trajectory reference


def alone(model, tokens, temperature):
    """(λ [n], H [n]) of one sequence run alone, token-aligned (index 0: nothing predicts it)."""
    n = len(tokens)
    step = Step(ids=("x",), trees=("x",), offsets=np.array([0, n]), tokens=np.asarray(tokens, dtype=TOKEN_DTYPE),
                loss_mask=np.zeros(n, dtype=np.uint8), rewards=np.zeros(1, dtype=np.float32),
                advantage_per_trajectory=np.zeros(1, dtype=np.float32))
    kda = model.config.kda
    layout = baseline_layout(step, np.array([0]), conv_size=kda.conv_size, chunk_size=kda.chunk_size)
    hidden, _ = model(layout.input_ids, layout)
    log_p = torch.log_softmax(hidden @ model.lm_head.weight.T / temperature, dim=-1)
    zero = log_p.new_zeros(1)
    logprobs = torch.cat([zero, log_p[:-1].gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0]])
    entropy = torch.cat([zero, -(log_p.exp() * log_p).sum(-1)[:-1]])
    return logprobs, entropy


def reference(model, pairs, places, size, temperature):
    """Per-trajectory λ and H, flat over the batch's positions (0 elsewhere), and the mask."""
    logprobs, entropy = torch.zeros(size), torch.zeros(size)
    mask = torch.zeros(size, dtype=torch.bool)
    for (prompt, response), place in zip(pairs, places):
        lp, h = alone(model, prompt + response, temperature)
        index = torch.from_numpy(place)
        logprobs, entropy = logprobs.index_put((index,), lp), entropy.index_put((index,), h)
        mask[index[1:]] = True
    return logprobs, entropy, mask


def flat(values):
    return torch.cat(values) if isinstance(values, list) else values.reshape(-1)


def num_unique_prefixes(pairs):
    return len({tuple((p + r)[: i + 1]) for p, r in pairs for i in range(len(p + r))})


CASES = {
    # name: (layout, sequences, per-token advantages)
    "grpo-4x8-verl": ("verl", "grpo", False),
    "grpo-4x8-left": ("left", "grpo", True),
    "grpo-4x8-right": ("right", "grpo", True),
    "grpo-4x8-packed": ("packed", "grpo", False),
    "grpo-4x8-trajectories": ("trajectories", "grpo", True),
    "no-sharing-right": ("right", "unshared", True),
    "no-sharing-left": ("left", "unshared", False),
}


def case_data(name, seed=0):
    layout, kind, per_token = CASES[name]
    rng = np.random.default_rng(42 + seed)
    pairs = grpo_sequences(rng) if kind == "grpo" else unshared_sequences(rng)
    fields = rl_fields(rng, pairs, per_token)
    batch, places = make_batch(layout, pairs, fields)
    size = (batch["input_ids"].numel() if isinstance(batch, dict) else sum(len(t["input_ids"]) for t in batch))
    return layout, pairs, fields, batch, places, size


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("case", CASES)
def test_logprobs_match_each_sequence_alone(model, case, temperature):
    layout, pairs, _, batch, places, size = case_data(case)
    with torch.no_grad():
        out = api.logprobs(model, batch, temperature=temperature, entropy=True)
        expected_lp, expected_h, expected_mask = reference(model, pairs, places, size, temperature)
    if layout in ("verl", "left", "right"):
        assert out.log_probs.shape == out.entropy.shape == out.mask.shape == batch["input_ids"].shape
    elif layout == "trajectories":
        assert [len(x) for x in out.log_probs] == [len(p + r) for p, r in pairs]
    assert torch.equal(flat(out.mask), expected_mask)
    assert float((flat(out.log_probs) - expected_lp).abs().max()) <= 1e-5
    assert float((flat(out.entropy) - expected_h).abs().max()) <= 1e-5
    # Where nothing is predicted the outputs are exactly 0.
    assert not flat(out.log_probs)[~expected_mask].any() and not flat(out.entropy)[~expected_mask].any()
    assert out.num_tokens == sum(len(p + r) for p, r in pairs)
    assert out.num_rows == num_unique_prefixes(pairs)
    if CASES[case][1] == "grpo":
        assert out.num_rows < 0.8 * out.num_tokens
    else:
        assert out.num_rows == out.num_tokens


@pytest.mark.parametrize("case", ["grpo-4x8-verl", "grpo-4x8-left", "grpo-4x8-packed", "grpo-4x8-trajectories"])
def test_step_keeps_only_values_the_loss_reads(case):
    """The converted step holds the batch's per-token values where the loss mask is 1 and 0
    elsewhere (per-sequence advantages stay per sequence): the NaN at padding and unmasked
    positions is not copied (a step can be written and read back)."""
    _, pairs, fields, batch, _, _ = case_data(case)
    step = api.as_batch(batch).step
    mask = np.concatenate([f["loss_mask"] for f in fields]).astype(bool)
    assert np.array_equal(step.loss_mask.astype(bool), mask)
    assert np.array_equal(step.tokens, np.concatenate([p + r for p, r in pairs]))
    for got, name in ((step.old_logprobs, "old_log_probs"), (step.ref_logprobs, "ref_log_probs"),
                      (step.advantages(), "advantages")):
        want = np.concatenate([np.broadcast_to(f[name], len(f["loss_mask"])) for f in fields])
        per_sequence = np.ndim(fields[0][name]) == 0
        assert np.array_equal(got, (want if per_sequence else np.where(mask, want, 0)).astype(np.float32)), name


def test_baseline_execution_and_moe_loss_agree(model):
    """The API's baseline execution (each sequence its own packed sequence, one call) gives the same
    log-probs and MoE loss as the compact one (the MoE loss is a batch quantity: no per-trajectory twin)."""
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    with torch.no_grad():
        compact = api.policy_loss(model, batch)
        baseline = api.policy_loss(model, batch, config=StepConfig(execution="baseline"))
    assert baseline.num_rows == baseline.num_tokens > compact.num_rows
    assert float((compact.log_probs - baseline.log_probs).abs().max()) <= 1e-5
    assert abs(float(compact.moe_loss - baseline.moe_loss)) <= 1e-6
    assert torch.equal(compact.loss, compact.policy_loss + compact.moe_loss)


# ---------------------------------------------------------------------------------------------
# The loss and its gradients


LOSSES = {
    "grpo-kl-clip-higher": StepConfig(loss="grpo", grpo=GRPOConfig(clip_ratio_high=0.28, kl_coef=0.1)),
    "ppo-dual-clip-seq-mean": StepConfig(
        loss="ppo", ppo=PPOConfig(dual_clip_ratio=3.0, aggregation="seq-mean-token-mean")
    ),
    "grpo-verl-kl-entropy": StepConfig(loss="grpo", grpo=GRPOConfig(
        dual_clip_ratio=3.0, log_ratio_clamp=20.0, kl_coef=0.1, kl_estimator="low_var_kl", entropy_coef=0.002,
        aggregation="seq-mean-token-sum")),
}


def near_policy(model, pairs, fields, rng, temperature):
    """The fields with old/ref log-probs = the current ones (alone) + noise where the loss mask is 1,
    so that part of the tokens is clipped."""
    with torch.no_grad():
        current = [alone(model, p + r, temperature)[0].numpy() for p, r in pairs]
    out = []
    for f, lp in zip(fields, current):
        mask = f["loss_mask"] == 1
        out.append(dict(f, **{name: np.where(mask, np.minimum(lp + 0.3 * rng.standard_normal(len(lp)), 0), np.nan)
                              for name in ("old_log_probs", "ref_log_probs")}))
    return out


def reference_loss(model, pairs, fields, places, size, config, temperature):
    """The loss of `harts.objective.losses` over the batch's positions, from per-trajectory log-probs (and
    entropies, for an entropy bonus). Values sit at the tokens they predict (shifted by one from the positions
    that predict them): the loss is a sum over positions, so the order does not matter."""
    logprobs, entropy, _ = reference(model, pairs, places, size, temperature)
    data = {name: torch.zeros(size, dtype=torch.float32) for name in ("loss_mask", "advantages", "old", "ref")}
    row = torch.zeros(size, dtype=torch.int64)
    for b, (f, place) in enumerate(zip(fields, places)):
        index = torch.from_numpy(place)
        mask = f["loss_mask"] == 1
        data["loss_mask"][index] = torch.from_numpy(mask.astype(np.float32))
        data["advantages"][index] = torch.from_numpy(np.where(mask, np.broadcast_to(f["advantages"], mask.shape), 0)
                                                     .astype(np.float32))
        data["old"][index] = torch.from_numpy(np.where(mask, f["old_log_probs"], 0).astype(np.float32))
        data["ref"][index] = torch.from_numpy(np.where(mask, f["ref_log_probs"], 0).astype(np.float32))
        row[index] = b
    common = dict(advantages_S=data["advantages"], loss_mask_S=data["loss_mask"].bool(), old_logprobs_S=data["old"],
                  trajectory_index_S=row)
    if (config.grpo if config.loss == "grpo" else config.ppo).entropy_coef > 0:
        common["entropy_S"] = entropy
    if config.loss == "grpo":
        return grpo_loss(logprobs, config=config.grpo, ref_logprobs_S=data["ref"], **common), common["loss_mask_S"]
    return ppo_loss(logprobs, config=config.ppo, **common), common["loss_mask_S"]


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "case, loss",
    [("grpo-4x8-verl", "grpo-kl-clip-higher"), ("grpo-4x8-verl", "ppo-dual-clip-seq-mean"),
     ("grpo-4x8-right", "ppo-dual-clip-seq-mean"), ("no-sharing-left", "grpo-kl-clip-higher")],
)
def test_loss_and_gradients_match_each_sequence_alone(model, case, loss):
    layout, pairs, fields, _, places, size = case_data(case)
    temperature = 0.8
    fields = near_policy(model, pairs, fields, np.random.default_rng(7), temperature)
    batch, _ = make_batch(layout, pairs, fields)
    config = LOSSES[loss]

    model.zero_grad(set_to_none=True)
    result = api.policy_loss(model, batch, config=config, temperature=temperature)
    result.policy_loss.backward()
    got = gradients(model)
    model.zero_grad(set_to_none=True)
    expected, mask = reference_loss(model, pairs, fields, places, size, config, temperature)
    expected.loss.backward()
    want = gradients(model)
    model.zero_grad(set_to_none=True)

    # The loss is a mean of per-token terms that partly cancel (advantages of both signs): its
    # fp32 error is relative to the terms' size, not to the (possibly small) loss.
    scale = float(expected.per_token_loss.detach().abs()[mask].mean())
    assert abs(float(result.policy_loss.detach() - expected.loss.detach())) <= 1e-6 * scale
    assert 0 < float(result.clip_fraction) < 1
    assert abs(float(result.clip_fraction - expected.clip_fraction)) <= 1e-6
    if config.loss == "grpo":
        assert abs(float(result.kl - expected.kl)) <= 1e-6
    assert got.keys() == want.keys() and len(got) == len(list(model.parameters()))
    worst = max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0)
    assert worst <= 1e-4


def test_normalizer_is_the_step_count(model):
    """A micro-batch's loss with the step's token count N is its own token-mean × (own count / N)."""
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    own = int(batch["response_mask"].sum())
    with torch.no_grad():
        alone_loss = api.policy_loss(model, batch).policy_loss
        of_step = api.policy_loss(model, batch, normalizer=4 * own, num_microbatches=4).policy_loss
    assert abs(float(of_step) - float(alone_loss) / 4) <= 1e-7


@pytest.mark.parametrize("layout", ["verl", "packed"])
def test_per_sequence_advantages_as_B_or_B1_mean_the_same(model, layout):
    """`adv.unsqueeze(-1)` ([B, 1]) is one advantage per sequence, as [B] is: not a response of width 1."""
    _, pairs, fields, _, _, _ = case_data("grpo-4x8-verl")
    batch, _ = make_batch(layout, pairs, fields)
    assert batch["advantages"].shape == (len(pairs),)
    column = dict(batch, advantages=batch["advantages"].unsqueeze(-1))
    with torch.no_grad():
        flat_loss = api.policy_loss(model, batch).policy_loss
        column_loss = api.policy_loss(model, column).policy_loss
    assert np.array_equal(api.as_batch(column).step.advantages(), api.as_batch(batch).step.advantages())
    assert float(flat_loss) != 0 and torch.equal(column_loss, flat_loss)


def _microbatches(batch, groups):
    """The padded batch's rows split into micro-batches of whole GRPO groups (row ranges)."""
    return [{name: value[lo:hi] for name, value in batch.items()} for lo, hi in groups]


@pytest.mark.parametrize("loss", LOSSES)
def test_microbatched_batch_adds_up_to_run_step(model, loss):
    """Micro-batches of whole GRPO groups with the step's normalizer and micro-batch count: their losses and
    gradients add up to `run_step` of the whole step on the same micro-batches, MoE losses included."""
    _, pairs, fields, _, _, _ = case_data("grpo-4x8-verl")
    fields = near_policy(model, pairs, fields, np.random.default_rng(3), 1.0)
    batch, _ = make_batch("verl", pairs, fields)
    config = LOSSES[loss]
    groups = [(0, 8), (8, 24), (24, 32)]
    whole = api.as_batch(batch)
    targets = semantic_targets_from_step(whole.step)
    normalizer = step_normalizer(targets, config)

    model.zero_grad(set_to_none=True)
    total = policy = moe = 0.0
    for part in _microbatches(batch, groups):
        result = api.policy_loss(model, part, config=config, normalizer=normalizer, num_microbatches=len(groups))
        result.loss.backward()
        total += float(result.loss.detach())
        policy += float(result.policy_loss.detach())
        moe += float(result.moe_loss)
    got = gradients(model)
    model.zero_grad(set_to_none=True)
    expected = run_step(model, whole.step, [np.arange(lo, hi) for lo, hi in groups], config)
    want = gradients(model)
    model.zero_grad(set_to_none=True)

    assert expected.moe_loss > 0
    assert abs(moe - expected.moe_loss) <= 1e-6 * expected.moe_loss
    assert abs(policy - expected.policy_loss) <= 1e-6 * max(abs(expected.policy_loss), 1e-3)
    assert abs(total - expected.loss) <= 1e-6 * max(abs(expected.loss), 1e-3)
    assert got.keys() == want.keys()
    assert max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0) <= 1e-4


@pytest.mark.parametrize("given", [dict(normalizer=10.0), dict(num_microbatches=2),
                                   dict(normalizer=10.0, num_microbatches=0), dict(normalizer=0.0, num_microbatches=2)],
                         ids=["normalizer-alone", "count-alone", "zero-count", "zero-normalizer"])
def test_microbatch_arguments_are_checked(model, given):
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    with pytest.raises(ValueError, match="policy_loss: "):
        api.policy_loss(model, batch, **given)


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group (DDP and fully_shard need one)."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _loss_and_gradients(model, batch, wrapped):
    result = api.policy_loss(wrapped, batch, entropy=True)
    result.loss.backward()
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for name, p in model.named_parameters()}
    return result, grads


@pytest.mark.parametrize("wrapper", ["ddp", "fully_shard", "compile-wrapper"])
def test_wrapped_models_give_the_plain_models_results(process_group, wrapper):
    """A DistributedDataParallel, FSDP2 (`fully_shard`) or `torch.compile`-wrapped model: the same loss, outputs and
    gradients as the plain model (world size 1)."""
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    plain = HybridModel(load_model_config("tiny"))
    plain.init_weights(seed=5)
    expected, want = _loss_and_gradients(plain, batch, plain)
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=5)
    if wrapper == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    elif wrapper == "fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        # What torch.compile returns (an OptimizedModule keeping the model as _orig_mod), without compiling.
        wrapped = torch._dynamo.eval_frame.OptimizedModule(model, torch._dynamo.eval_frame.innermost_fn(lambda f: f))
    result, got = _loss_and_gradients(model, batch, wrapped)
    assert torch.allclose(result.loss, expected.loss, rtol=1e-6, atol=0)
    assert float((result.log_probs - expected.log_probs).abs().max()) <= 1e-6
    assert max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0) <= 1e-5


def test_a_model_that_is_not_harts_is_refused():
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    with pytest.raises(ValueError, match="expected a HybridModel or a wrapper of one .* got Linear"):
        api.logprobs(torch.nn.Linear(4, 4), batch)


def test_entropy_is_differentiable(model):
    """An entropy bonus back-propagates: its gradient equals the per-trajectory one."""
    layout, pairs, _, batch, places, size = case_data("grpo-4x8-left")
    model.zero_grad(set_to_none=True)
    out = api.logprobs(model, batch, temperature=0.7, entropy=True)
    out.entropy.sum().backward()
    got = gradients(model)
    model.zero_grad(set_to_none=True)
    reference(model, pairs, places, size, 0.7)[1].sum().backward()
    want = gradients(model)
    model.zero_grad(set_to_none=True)
    assert max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0) <= 1e-4


# ---------------------------------------------------------------------------------------------
# Planned microbatches: a mini-batch as one step


def moe_model(aux_loss_coeff=0.5, z_loss_coeff=0.05):
    """The fixture's tiny model with MoE loss coefficients large enough that their gradients weigh in the
    comparisons (tiny's own 0.01 and 0.001 would hide a misnormalised MoE loss below the gradient tolerance)."""
    config = load_model_config("tiny")
    config = dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff))
    model = HybridModel(config)
    model.init_weights(seed=42)
    return model


def relative_gradient_error(got, want):
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0)


CAPACITIES = {"groups-whole": 200, "groups-split": 90}
"""Compact rows per microbatch: 200 holds one GRPO group (116-142 rows) but not two; 90 splits every group."""


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("loss", LOSSES)
def test_planned_step_equals_one_microbatch(loss, capacity):
    """A batch planned into microbatches and run by `policy_step` (gradient accumulation) gives the loss, the MoE
    losses and every gradient of the whole batch run as ONE microbatch (`policy_loss`: one forward over all rows),
    and the per-token outputs of each sequence alone."""
    _, pairs, fields, _, places, size = case_data("grpo-4x8-verl")
    model = moe_model()
    fields = near_policy(model, pairs, fields, np.random.default_rng(3), 1.0)
    batch, _ = make_batch("verl", pairs, fields)
    config = LOSSES[loss]
    plan = api.plan(batch, CAPACITIES[capacity])
    assert all(rows <= CAPACITIES[capacity] for rows in plan.num_rows) and len(plan.microbatches) >= 4
    groups = [set(m.tolist()) for m in plan.microbatches]
    if capacity == "groups-whole":  # every GRPO group (8 consecutive rows) in one microbatch
        assert sorted(tuple(sorted(g)) for g in groups) == [tuple(range(8 * i, 8 * i + 8)) for i in range(4)]

    model.zero_grad(set_to_none=True)
    one = api.policy_loss(model, batch, config=config)
    one.loss.backward()
    want = gradients(model)
    model.zero_grad(set_to_none=True)
    step = api.policy_step(model, plan, config=config, entropy=True)
    got = gradients(model)
    model.zero_grad(set_to_none=True)

    assert step.num_microbatches == len(plan.microbatches) and step.num_rows == sum(plan.num_rows)
    assert step.num_rows > one.num_rows if capacity == "groups-split" else step.num_rows == one.num_rows
    assert float(one.moe_loss.detach()) > 0.1 * abs(float(one.policy_loss.detach()))
    assert abs(float(step.moe_loss) - float(one.moe_loss.detach())) <= 1e-6 * float(one.moe_loss.detach())
    one_policy = float(one.policy_loss.detach())
    assert abs(float(step.policy_loss) - one_policy) <= 1e-6 * max(abs(one_policy), 1e-2)
    assert abs(float(step.loss) - float(one.loss.detach())) <= 1e-6 * abs(float(one.loss.detach()))
    assert abs(float(step.clip_fraction) - float(one.clip_fraction.detach())) <= 1e-6
    assert relative_gradient_error(got, want) <= 1e-4
    with torch.no_grad():
        expected_lp, expected_h, expected_mask = reference(model, pairs, places, size, 1.0)
    assert torch.equal(flat(step.mask), expected_mask)
    assert float((flat(step.log_probs) - expected_lp).abs().max()) <= 1e-5
    assert float((flat(step.entropy) - expected_h).abs().max()) <= 1e-5


@pytest.mark.parametrize("loss", LOSSES)
def test_planned_step_equals_each_sequence_alone(loss):
    """Without MoE losses, the planned step's loss and gradients are the per-trajectory oracle's."""
    layout, pairs, fields, _, places, size = case_data("grpo-4x8-right")
    model = moe_model(0.0, 0.0)
    temperature = 0.8
    fields = near_policy(model, pairs, fields, np.random.default_rng(7), temperature)
    batch, _ = make_batch(layout, pairs, fields)
    config = LOSSES[loss]
    model.zero_grad(set_to_none=True)
    step = api.policy_step(model, api.plan(batch, CAPACITIES["groups-split"]), config=config, temperature=temperature)
    got = gradients(model)
    model.zero_grad(set_to_none=True)
    expected, mask = reference_loss(model, pairs, fields, places, size, config, temperature)
    expected.loss.backward()
    want = gradients(model)
    model.zero_grad(set_to_none=True)
    scale = float(expected.per_token_loss.detach().abs()[mask].mean())
    assert abs(float(step.policy_loss) - float(expected.loss.detach())) <= 1e-6 * scale
    assert float(step.moe_loss) == 0.0
    assert relative_gradient_error(got, want) <= 1e-4


def test_replicas_add_up_to_the_step():
    """D = 2: each replica runs its microbatches (the plan's replica k mod 2); the two replicas' losses and
    gradients add up to the whole batch's (z-loss on: its share needs only the batch's tokens)."""
    _, pairs, fields, _, _, _ = case_data("grpo-4x8-verl")
    model = moe_model(0.0, 0.5)
    fields = near_policy(model, pairs, fields, np.random.default_rng(5), 1.0)
    batch, _ = make_batch("verl", pairs, fields)
    plan = api.plan(batch, CAPACITIES["groups-split"], dp=2)
    assert len(plan.microbatches) % 2 == 0
    model.zero_grad(set_to_none=True)
    one = api.policy_loss(model, batch)
    one.loss.backward()
    want = gradients(model)
    model.zero_grad(set_to_none=True)
    parts = [api.policy_step(model, plan, rank=rank) for rank in (0, 1)]
    got = gradients(model)
    model.zero_grad(set_to_none=True)
    assert abs(sum(float(p.loss) for p in parts) - float(one.loss.detach())) <= 1e-6 * abs(float(one.loss.detach()))
    one_moe = float(one.moe_loss.detach())
    assert abs(sum(float(p.moe_loss) for p in parts) - one_moe) <= 1e-6 * one_moe
    assert relative_gradient_error(got, want) <= 1e-4
    masks = [p.mask for p in parts]
    assert not (masks[0] & masks[1]).any() and torch.equal(masks[0] | masks[1], one.mask)
    assert sum(p.num_tokens for p in parts) == one.num_tokens


@pytest.mark.parametrize("wrapper", ["ddp", "fully_shard"])
def test_wrapped_model_runs_the_planned_step(process_group, wrapper):
    """A DistributedDataParallel or FSDP2 model (one process): the planned step's loss and gradients are the plain
    model's (it reduces after the last microbatch only)."""
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    plan = api.plan(batch, CAPACITIES["groups-whole"])
    plain = moe_model()
    expected = api.policy_step(plain, plan)
    want = gradients(plain)
    model = moe_model()
    if wrapper == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    result = api.policy_step(wrapped, plan)
    got = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
           for name, p in model.named_parameters() if p.grad is not None}
    assert abs(float(result.loss) - float(expected.loss)) <= 1e-6 * abs(float(expected.loss))
    assert relative_gradient_error(got, want) <= 1e-5


def test_load_balancing_over_replicas_needs_torch_distributed():
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    with pytest.raises(ValueError, match="policy_step: the load-balancing loss of a step over D = 2 replicas"):
        api.policy_step(moe_model(), api.plan(batch, CAPACITIES["groups-split"], dp=2))


def test_planned_logprobs_equal_one_microbatch(model):
    _, _, _, batch, _, _ = case_data("grpo-4x8-left")
    with torch.no_grad():
        one = api.logprobs(model, batch, entropy=True)
        planned = api.logprobs(model, api.plan(batch, CAPACITIES["groups-split"]), entropy=True)
    assert planned.num_rows > one.num_rows
    assert torch.equal(planned.mask, one.mask)
    assert float((planned.log_probs - one.log_probs).abs().max()) <= 1e-5
    assert float((planned.entropy - one.entropy).abs().max()) <= 1e-5


def test_a_batch_over_capacity_is_refused_or_planned(model):
    """One microbatch over the capacity is refused (never run oversized); a sequence longer than the capacity
    cannot be planned; a plan of one execution does not run the other."""
    _, _, _, batch, _, _ = case_data("grpo-4x8-verl")
    with pytest.raises(ValueError, match=r"padded batch: 501 rows \(compact execution\) in one microbatch, more "
                                         r"than the capacity 200: plan the batch"):
        api.policy_loss(model, batch, capacity=200)
    with pytest.raises(ValueError, match="padded batch: 501 rows"):
        api.logprobs(model, batch, capacity=200)
    with torch.no_grad():
        assert api.policy_loss(model, batch, capacity=501).num_rows == 501
    with pytest.raises(ValueError, match=r"trajectory '\d+' has \d+ tokens, more than the capacity T = 20"):
        api.plan(batch, 20)
    with pytest.raises(ValueError, match="the plan bounds compact rows but the baseline execution runs semantic"):
        api.policy_step(model, api.plan(batch, 200), config=StepConfig(execution="baseline"))
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        api.plan(batch, 0)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 1\)"):
        api.policy_step(model, api.plan(batch, 200), rank=1)


# ---------------------------------------------------------------------------------------------
# Padding side and bad input


def _padded(rows_real):
    """input_ids/attention_mask with real tokens at the given (start, stop) column ranges, L = 8."""
    ids = torch.full((len(rows_real), 8), PAD)
    attention = torch.zeros(len(rows_real), 8, dtype=torch.int64)
    for b, (lo, hi) in enumerate(rows_real):
        ids[b, lo:hi] = torch.arange(lo, hi) + 1
        attention[b, lo:hi] = 1
    return dict(input_ids=ids, attention_mask=attention)


@pytest.mark.parametrize("side, ok", [("left", True), ("right", False), (None, True)])
def test_padding_side_is_checked(side, ok):
    batch = _padded([(3, 8), (0, 8)])
    if ok:
        converted = api.padded_batch(batch, padding_side=side)
        assert converted.step.lengths.tolist() == [5, 8]
        assert converted.step.trajectory_tokens(0).tolist() == [4, 5, 6, 7, 8]
    else:
        message = r"padding_side 'right' but row 0 starts with padding \(first real token at column 3\)"
        with pytest.raises(ValueError, match=message):
            api.padded_batch(batch, padding_side=side)


def _bad(case):
    """(function, arguments, message) of each malformed input."""
    base = _padded([(2, 8), (0, 6)])
    mask = torch.zeros(2, 8, dtype=torch.int64)
    mask[0, 5:], mask[1, 3:6] = 1, 1
    with_mask = dict(base, loss_mask=mask)
    cases = {
        "hole-in-attention": (dict(base, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1] * 8])),
                              r"padded batch: field 'attention_mask': row 0 is not one contiguous run of real tokens "
                              r"\(0 at column 2 between 1s\)"),
        "empty-row": (dict(base, attention_mask=torch.tensor([[0] * 8, [1] * 8])),
                      "field 'attention_mask': row 0 has no real token"),
        "attention-not-0-1": (dict(base, attention_mask=base["attention_mask"] * 2),
                              r"field 'attention_mask': expected 0/1 values, got 2 at index \[0, 2\]"),
        "float-input-ids": (dict(base, input_ids=base["input_ids"].float()),
                            "field 'input_ids': expected integers, got float32"),
        "loss-mask-on-padding": (dict(base, loss_mask=mask.index_put((torch.tensor([1]), torch.tensor([7])),
                                                                     torch.tensor([1]))),
                                 r"field 'loss_mask': 1 at row 1, column 7, which is padding"),
        "loss-mask-on-first-token": (dict(base, loss_mask=torch.tensor([[0, 0, 1, 0, 0, 0, 0, 0], [0] * 8])),
                                     r"field 'loss_mask': 1 at row 0, column 2, the first token of its sequence"),
        "nan-advantage-where-masked": (
            dict(with_mask, advantages=torch.where(torch.arange(8) == 4, float("nan"), torch.ones(2, 8))),
            r"field 'advantages': nan at row 1, column 4, where the loss mask is 1"),
        "inf-old-log-prob-in-response": (
            dict(with_mask, old_log_probs=torch.tensor([[0.0] * 7 + [-float("inf")]] * 2)[:, 4:]),
            r"field 'old_log_probs': -inf at row 0, column 7, where the loss mask is 1"),
        "positive-old-log-prob-where-masked": (
            dict(with_mask, old_log_probs=torch.where(torch.arange(8) == 5, 0.25, -1.0).expand(2, 8)),
            r"field 'old_log_probs': 0.25 at row 0, column 5, where the loss mask is 1 "
            r"\(log-probabilities must be in \[-10000, 0\]\)"),
        "huge-negative-old-log-prob": (dict(with_mask, old_log_probs=torch.full((2, 8), -3e38)),
                                       r"field 'old_log_probs': -3.*e\+38 at row 0, column 5, where the loss mask is 1 "
                                       r"\(log-probabilities must be in \[-10000, 0\]\)"),
        "positive-ref-log-prob-packed": ({"input_ids": torch.arange(6), "cu_seqlens": torch.tensor([0, 4, 6]),
                                          "loss_mask": torch.tensor([0, 1, 1, 1, 0, 1]),
                                          "ref_log_probs": torch.tensor([0, -1, -1, -1, 0, 1e-3])},
                                         "packed batch: field 'ref_log_probs': 0.001.* at sequence 1, token 1"),
        "response-widths-differ": (dict(base, response_mask=mask[:, 3:], old_log_probs=torch.zeros(2, 4)),
                                   r"field 'old_log_probs': \[2, 4\] but field 'loss_mask' is \[2, 5\]"),
        "advantages-B2": (dict(with_mask, advantages=torch.zeros(3, 1)),
                          r"field 'advantages': expected shape \[2, L\] or \[2, R\]"),
        "wider-than-input": (dict(with_mask, advantages=torch.zeros(2, 9)),
                             r"field 'advantages': expected shape \[2, L\] or \[2, R\] with R <= L = 8"),
        "misspelled-field": (dict(with_mask, old_logprobs=torch.zeros(2, 8)),
                             r"padded batch: unknown field 'old_logprobs' \(accepted: .*old_log_probs"),
        "two-names": (dict(with_mask, response_mask=mask), "field 'response_mask' given twice"),
        "no-attention-mask": ({"input_ids": base["input_ids"]}, "field 'attention_mask' is required"),
        "bad-padding-side": ((base,), "padding_side must be one of"),
        "cu-seqlens-short": ({"input_ids": torch.arange(6), "cu_seqlens": torch.tensor([0, 4])},
                             r"packed batch: field 'cu_seqlens': expected \[B \+ 1\] offsets from 0 to T = 6"),
        "cu-seqlens-empty-sequence": ({"input_ids": torch.arange(6), "cu_seqlens": torch.tensor([0, 4, 4, 6])},
                                      "packed batch: field 'cu_seqlens': sequence 1 is empty"),
        "packed-nan-old": ({"input_ids": torch.arange(6), "cu_seqlens": torch.tensor([0, 4, 6]),
                            "loss_mask": torch.tensor([0, 1, 1, 1, 0, 1]),
                            "old_log_probs": torch.tensor([0, 0, 0, 0, 0, float("nan")])},
                           "packed batch: field 'old_log_probs': nan at sequence 1, token 1"),
        "trajectory-length": ([{"input_ids": torch.arange(4), "loss_mask": torch.tensor([0, 1, 1])}],
                              r"trajectory batch: trajectory 0: field 'loss_mask': shape \(3,\) does not match"),
        "trajectory-missing-field": (
            [{"input_ids": torch.arange(4), "advantages": 1.0}, {"input_ids": torch.arange(3)}],
            "trajectory batch: trajectory 1: has fields"),
    }
    return cases[case]


BAD = ["hole-in-attention", "empty-row", "attention-not-0-1", "float-input-ids", "loss-mask-on-padding",
       "loss-mask-on-first-token", "nan-advantage-where-masked", "inf-old-log-prob-in-response", "wider-than-input",
       "positive-old-log-prob-where-masked", "huge-negative-old-log-prob", "positive-ref-log-prob-packed", "response-widths-differ", "advantages-B2",
       "misspelled-field", "two-names", "no-attention-mask", "bad-padding-side", "cu-seqlens-short",
       "cu-seqlens-empty-sequence", "packed-nan-old", "trajectory-length", "trajectory-missing-field"]


@pytest.mark.parametrize("case", BAD)
def test_bad_batches_are_refused_with_the_place(case):
    batch, message = _bad(case)
    with pytest.raises(ValueError, match=message):
        if case == "bad-padding-side":
            api.padded_batch(*batch, padding_side="top")
        else:
            api.as_batch(batch)


@pytest.mark.parametrize("case", ["token-outside-vocabulary", "no-loss-mask", "no-advantages", "kl-without-ref"])
def test_bad_requests_are_refused(model, case):
    batch = _padded([(2, 8), (0, 6)])
    mask = torch.zeros(2, 8, dtype=torch.int64)
    mask[:, 5] = 1
    config = None
    if case == "token-outside-vocabulary":
        batch["input_ids"][1, 3] = VOCAB
        message = rf"padded batch: field 'input_ids': token {VOCAB} at row 1, column 3 is outside the model's vocab"
        batch.update(loss_mask=mask, advantages=torch.ones(2))
    elif case == "no-loss-mask":
        batch.update(advantages=torch.ones(2))
        message = "policy_loss needs a loss mask"
    elif case == "no-advantages":
        batch.update(loss_mask=mask)
        message = "policy_loss needs field 'advantages'"
    else:
        batch.update(loss_mask=mask, advantages=torch.ones(2))
        config = StepConfig(grpo=GRPOConfig(kl_coef=0.1))
        message = "kl_coef > 0 needs field 'ref_log_probs'"
    with pytest.raises(ValueError, match=message):
        api.policy_loss(model, batch, config=config)


# ---------------------------------------------------------------------------------------------
# The library page's example runs (docs/library.md, "RL batch API")


def library_example(heading: str = "RL batch API") -> str:
    text = (Path(__file__).resolve().parents[1] / "docs/library.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section has one Python example"
    return blocks[0]


def test_library_example_runs(capsys):
    exec(compile(library_example(), "docs/library.md (RL batch API)", "exec"), {})
    rows, tokens = map(int, re.search(r"(\d+) rows computed for (\d+) tokens", capsys.readouterr().out).groups())
    assert rows < tokens  # the groups' prompts are shared


def test_planned_example_runs(capsys):
    exec(compile(library_example("Planned mini-batches"), "docs/library.md (Planned mini-batches)", "exec"), {})
    printed = capsys.readouterr().out
    count, rows = map(int, re.search(r"(\d+) microbatches, loss -?[\d.]+, (\d+) rows", printed).groups())
    assert (count, rows) == (4, 4 * 88)  # one group per microbatch, as the page says
