"""The online RL loop: both executions from the same initial policy agree at step 0 and train (also with
bf16 parameters, the CUDA default); a run is deterministic per seed; the step built from trees (GRPO within each tree), the log-prob shift of the
reference, the warm start; the pooled load-balancing loss in both executions' step records; (slow) the reward rises
over 40 steps in both executions."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from harts.rl.config import load_rl_config, resolve
from harts.rl.loop import initial_model, make_step, run_seed, step_from_trajectories, target_logprobs, warm_start
from harts.rollout.env import LookupEnv
from harts.rollout.generate import Trajectory
from harts.trees.step import grpo_advantages

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "rl" / "tiny.yaml"


def _config(**changes):
    return resolve(replace(load_rl_config(TINY), **changes))


def _without_seconds(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.fixture(scope="module")
def tiny_run():
    return run_seed(_config(), seed=0)


def test_both_executions_start_from_the_same_policy_and_trees(tiny_run):
    warm, records = tiny_run
    compact, baseline = records["compact"], records["baseline"]
    assert warm["steps"] == 2 and warm["nll_last"] < warm["nll_first"]
    assert [r["step"] for r in compact] == [0, 1, 2, 3] and [r["update"] for r in compact] == [True] * 3 + [False]
    first_c, first_b = compact[0], baseline[0]
    for key in ("reward", "reward_all", "trajectories", "semantic_tokens", "compact_tokens", "tool_calls"):
        assert first_c[key] == first_b[key], key
    # The policy is the reference at step 0: the same weights, the same execution, the same rows.
    assert first_c["kl"] == first_b["kl"] == 0.0
    assert first_c["loss"] == pytest.approx(first_b["loss"], rel=1e-5, abs=1e-7)
    assert first_c["compression"] > 2, "the prefix and the prompts are shared"
    for c, b in zip(compact, baseline):
        assert b["rows"] == b["semantic_tokens"] and c["rows"] == c["compact_tokens"] < c["semantic_tokens"]
        assert c["compression"] == c["semantic_tokens"] / c["compact_tokens"]
    assert all(r["kl"] > 0 for r in compact[1:] + baseline[1:]), "an update moves the policy away from the reference"
    last = compact[-1]
    assert last["grad_norm"] is None and last["lr"] is None and last["seconds"]["backward"] == 0.0
    seconds = compact[0]["seconds"]
    parts = ("plan", "layout", "forward", "backward", "optimizer")
    assert seconds["train"] == pytest.approx(sum(seconds[k] for k in parts)) and seconds["sample"] > 0


def test_a_run_is_deterministic_per_seed(tiny_run):
    again = run_seed(_config(), seed=0)
    assert again[0] == tiny_run[0]
    for execution in ("compact", "baseline"):
        assert _without_seconds(again[1][execution]) == _without_seconds(tiny_run[1][execution])
    other = run_seed(_config(num_steps=1, executions=["compact"]), seed=1)[1]["compact"]
    assert other[0]["loss"] != tiny_run[1]["compact"][0]["loss"]


def test_bf16_parameters():
    """The CUDA default dtype on the CPU: bf16 weights (sampling decodes in bf16) with fp32 masters; both
    executions start from the same policy and trees and take a finite step."""
    tiny = load_rl_config(TINY)
    config = _config(dtype="bf16", num_steps=1, warm_start=replace(tiny.warm_start, steps=0),
                     rollout=replace(tiny.rollout, retry_prob=1.0))
    assert initial_model(config, 0).embed.weight.dtype == torch.bfloat16
    _, records = run_seed(config, seed=0)
    compact, baseline = records["compact"], records["baseline"]
    for key in ("reward", "trajectories", "semantic_tokens", "compact_tokens"):
        assert compact[0][key] == baseline[0][key], key
    assert compact[0]["kl"] == baseline[0]["kl"] == 0.0
    assert all(np.isfinite(r["loss"]) and r["kl"] is not None for r in compact + baseline)
    assert compact[1]["kl"] > 0 and baseline[1]["kl"] > 0


def test_recompute_blocks_auto_searches_before_each_learners_first_update(monkeypatch):
    """With recompute_blocks auto (the CPU allowed to search a simulated device where fewer than 3 of the tiny model's
    4 blocks run out of memory), each learner searches before its first update, leaving room for every learner's
    AdamW moments not yet allocated (at step 0 the compact learner goes first: both learners' moments; then the
    baseline's alone); a later search only for a microbatch outside those searched on (each update's, when the
    searched ones are forgotten), from the blocks found; the final forward-only step searches nothing. The run is the
    run with 3 blocks given, bit for bit."""
    from harts import engine as engine_module
    from harts import engine_memory
    from harts.config import execution
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel

    run_step = engine_module.run_step

    def simulated(model, step, microbatches, config, **kwargs):
        if config.recompute_blocks is not None and config.recompute_blocks < 3:  # the warm start recomputes none
            raise torch.OutOfMemoryError("simulated")
        return run_step(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", simulated)
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(engine_memory, "device_memory_bytes", lambda device: 1 << 50)
    tiny = load_rl_config(TINY)

    def run(blocks):
        # A KL term: the probes run the step's loss, which then reads the reference log-probs.
        config = _config(execution=replace(tiny.execution, recompute=True, recompute_blocks=blocks),
                         loss=replace(tiny.loss, grpo=replace(tiny.loss.grpo, kl_coef=0.05)))
        return run_seed(config, seed=0)[1]

    given, auto = run(3), run("auto")
    moments = 2 * 4 * sum(p.numel() for p in HybridModel(load_model_config("tiny")).parameters())  # fp32 masters
    for execution_name, reserved in (("compact", 2 * moments), ("baseline", moments)):
        records = auto[execution_name]
        first = records[0]["recompute_search"]
        assert (first["reason"], first["recompute_blocks"], first["reserved_bytes"]) == ("not searched yet", 3,
                                                                                         reserved)
        tries = [(p["recompute_blocks"], p["fits"]) for p in first["probes"]]
        assert tries == [(4, True), (1, False), (2, False), (3, True)]
        later = [r["recompute_search"] for r in records[1:] if "recompute_search" in r]
        assert all(s["reason"].startswith("a microbatch of ") and s["recompute_blocks"] == 3 for s in later)
        assert "recompute_search" not in records[-1] and not records[-1]["update"]
        assert _without_seconds([{k: v for k, v in r.items() if k != "recompute_search"} for r in records]) == (
            _without_seconds(given[execution_name]))

    # Rollouts of other sizes: with the searched microbatches forgotten after each search, every later update's
    # microbatch is outside them, so each update searches again (one try, of the 3 blocks found), no other step.
    # Every learner's gradients are freed after its update, so no search runs beside another's (the search leaves
    # room for moments, not gradients).
    import harts.rl.loop as rl_loop

    fit, update, updated = engine_module.Engine.fit_recompute_blocks, rl_loop.apply_update, []

    def fit_and_forget(self, *args, **kwargs):
        assert all(p.grad is None for model in updated for p in model.parameters())
        search = fit(self, *args, **kwargs)
        self.searched_extents = [(1, 1, 1)]
        return search

    def tracked_update(model, *args, **kwargs):
        updated.append(model)
        return update(model, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "fit_recompute_blocks", fit_and_forget)
    monkeypatch.setattr(rl_loop, "apply_update", tracked_update)
    again = run("auto")
    for execution_name in ("compact", "baseline"):
        searches = [r.get("recompute_search") for r in again[execution_name]]
        assert searches[0]["reason"] == "not searched yet" and searches[-1] is None
        assert all(s["reason"].startswith("a microbatch of ") and s["reserved_bytes"] == 0
                   and [(p["recompute_blocks"], p["fits"]) for p in s["probes"]] == [(3, True)] for s in searches[1:-1])


def test_step_from_trajectories():
    def trajectory(tree, sample, retry, tokens, reward):
        return Trajectory(tree=tree, sample=sample, retry=retry, tokens=tokens, loss_mask=[0] + [1] * (len(tokens) - 1),
                          logprobs=[0.0] * len(tokens), forked_at=1, reward=reward)

    trajectories = [trajectory(0, 0, None, [1, 5, 6], 1.0), trajectory(1, 0, None, [1, 7], 0.0),
                    trajectory(0, 0, 0, [1, 5, 7, 8], 0.0), trajectory(1, 1, None, [1, 9], 1.0)]
    step = step_from_trajectories(trajectories)
    assert step.ids == ("t0/s0", "t1/s0", "t0/s0/r0", "t1/s1") and step.trees == ("t0", "t1", "t0", "t1")
    assert step.offsets.tolist() == [0, 3, 5, 9, 11] and step.tokens.tolist() == [1, 5, 6, 1, 7, 1, 5, 7, 8, 1, 9]
    assert step.loss_mask.tolist() == [0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1]
    assert step.advantage_per_trajectory.tolist() == grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0]),
                                                                     step.trees).tolist()
    assert step.advantage_per_trajectory[0] > 0 > step.advantage_per_trajectory[2]
    assert step.old_logprobs is None and step.ref_logprobs is None
    explicit = make_step(["a"], ["a"], [[1, 2]], [[0, 1]], [0.5], np.array([2.0]))
    assert explicit.advantage_per_trajectory.tolist() == [2.0] and explicit.rewards.tolist() == [0.5]


def test_target_logprobs_move_each_position_to_the_token_it_predicts():
    step = make_step(["a", "b"], ["t", "t"], [[1, 2, 3], [1, 4]], [[0, 1, 1], [0, 1]], [0.0, 1.0], np.zeros(2))
    # Position p predicts token p + 1; the last position of a trajectory predicts nothing.
    logprobs = torch.tensor([-0.1, -0.2, -9.0, -0.4, -9.0])
    assert target_logprobs(step, logprobs).tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, -0.4])


def test_warm_start_is_deterministic_and_learns():
    config = _config(warm_start=replace(load_rl_config(TINY).warm_start, steps=6))
    env = LookupEnv(config.env)
    first, second = initial_model(config, 3), initial_model(config, 3)
    summary = warm_start(first, env, config, seed=3)
    assert warm_start(second, env, config, seed=3) == summary
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert summary["nll_last"] < summary["nll_first"] and 0 < summary["demonstration_reward"] < 1
    assert warm_start(initial_model(config, 3), env, _config(warm_start=replace(config.warm_start, steps=0)),
                      seed=3) == {"steps": 0}


@pytest.mark.slow
def test_the_reward_rises_in_both_executions():
    """40 steps of the shipped CPU config (two seeds' worth of trees per step), about 3 minutes: slow
    because learning needs that many steps."""
    config = resolve(replace(load_rl_config(REPO / "configs" / "rl" / "cpu.yaml"), num_steps=40))
    _, records = run_seed(config, seed=0)
    for execution, steps in records.items():
        rewards = np.array([s["reward"] for s in steps])
        assert rewards[-10:].mean() > rewards[:10].mean() + 0.1, (execution, rewards)


def test_step_records_carry_the_pooled_balance_loss():
    """With `loss.pooled_balance_coeff` c, both executions' step records give `pooled_balance_loss` as `harts train`'s
    do (the mean over microbatches of the loss without c; c × it is in `moe_loss`); without it, no such key. Step 0
    (the initial weights, the same trees, the same two microbatches) gives the same loss in both executions and c × it
    more MoE loss than the run without."""
    tiny = load_rl_config(TINY)
    changes = dict(model="gdn-tiny", num_steps=1, warm_start=replace(tiny.warm_start, steps=0),
                   execution=replace(tiny.execution, planner="harts", capacity=20))
    records = run_seed(_config(**changes, loss=replace(tiny.loss, pooled_balance_coeff=0.5)), seed=0)[1]
    plain = run_seed(_config(**changes), seed=0)[1]
    for execution in ("compact", "baseline"):
        assert all("pooled_balance_loss" not in r for r in plain[execution])
        assert all(np.isfinite(r["pooled_balance_loss"]) and r["pooled_balance_loss"] > 0 for r in records[execution])
        first, without = records[execution][0], plain[execution][0]
        assert first["semantic_tokens"] == without["semantic_tokens"] and first["microbatches"] == 2
        assert first["moe_loss"] - without["moe_loss"] == pytest.approx(0.5 * first["pooled_balance_loss"], rel=1e-5)
    assert records["compact"][0]["pooled_balance_loss"] == pytest.approx(records["baseline"][0]["pooled_balance_loss"],
                                                                         rel=1e-5)
