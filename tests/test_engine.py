"""The engine: a planned step's members are the plan's trajectories in the step's batch order, the plan follows the
config's planner and capacity, and a step run through the engine is `run_step` over the same members (the same
loss and gradients, bitwise: the same calls in the same order); a microbatch through the engine is
`microbatch_logprobs` on `build_layout`'s rows (a layout over a capacity refused before the model runs), and its
load-balancing counts are each microbatch's routing summed (from `moe.balance_statistics` when the layers' own
load-balancing loss is off; refused when neither reports them)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.config.execution import ExecutionConfig
from harts.engine import Engine, OverCapacity, plan_step
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import build_layout, microbatch_logprobs, run_step, semantic_index
from harts.objective.targets import semantic_targets_from_step
from harts.trees.io import read_step
from harts.trees.trie import PrefixIndex
from tests.fixtures import one_thread  # noqa: F401

STEP = "data/samples/tiny-step.jsonl.gz"


@pytest.fixture(scope="module")
def step():
    return read_step(STEP, vocab_size=256)


@pytest.mark.parametrize("execution, planner, capacity", [
    ("compact", None, 1024), ("baseline", None, 1024), ("compact", "greedy-trie", 512), ("compact", "harts", 300),
], ids=["compact-default", "baseline-default", "greedy-trie", "small-capacity"])
def test_plan_follows_the_config_and_covers_the_step(step, execution, planner, capacity):
    config = ExecutionConfig(planner=planner, capacity=capacity).resolved("cpu", execution)
    planned = plan_step(step, config)
    assert planned.plan.planner == (planner or ("harts" if execution == "compact" else "per-trajectory"))
    assert planned.plan.capacity == capacity
    members = np.sort(np.concatenate(planned.microbatches))
    assert members.tolist() == list(range(step.num_trajectories))
    for microbatch, members_of in zip(planned.plan.microbatches, planned.microbatches):
        assert [step.ids[k] for k in members_of] == list(microbatch.trajectory_ids)
        assert members_of.dtype == np.int64
    assert planned.num_microbatches == len([m for m in planned.microbatches if len(m)])


def test_plan_keeps_empty_microbatches_of_idle_replicas(step):
    config = ExecutionConfig(capacity=100_000).resolved("cpu", "compact")
    planned = plan_step(step, config, dp=16)  # more replicas than the step's 10 trajectories
    assert len(planned.microbatches) % 16 == 0 and planned.num_microbatches < len(planned.microbatches)


def test_a_run_is_run_step_over_the_planned_members(step):
    torch.manual_seed(0)
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    engine = Engine.build(model, ExecutionConfig(capacity=300), "cpu", execution="compact")
    planned = engine.plan(step)
    assert planned.num_microbatches > 1
    result = engine.run(step, planned)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = run_step(model, step, planned.microbatches, engine.config, index=planned.index)
    assert result.loss == expected.loss and result.num_rows == expected.num_rows
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    model.zero_grad()
    forward_only = engine.run(step, planned, backward=False)
    assert forward_only.loss == expected.loss and all(p.grad is None for p in model.parameters())


def test_the_configs_experts_backend_is_the_one_that_runs(step, monkeypatch):
    """An engine runs its config's experts_backend whatever the model's config says (a checkpoint loaded by a trainer
    adapter carries "auto"), and each of two engines sharing a model runs its own; without one, the model's."""
    from harts.model.moe import MoE

    calls = []
    for name in ("lean_experts", "loop_experts"):
        original = getattr(MoE, name)
        monkeypatch.setattr(MoE, name, lambda self, *a, name=name, original=original: (calls.append(name),
                                                                                          original(self, *a))[1])
    torch.manual_seed(0)
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    members = np.arange(2)
    lean = Engine.build(model, ExecutionConfig(experts_backend="lean"), "cpu", execution="compact")
    loop = Engine.build(model, ExecutionConfig(experts_backend="loop"), "cpu", execution="compact")
    own = Engine.build(model, ExecutionConfig(), "cpu", execution="compact")
    for engine, expected in [(lean, "lean_experts"), (loop, "loop_experts"), (lean, "lean_experts"),
                             (own, "lean_experts")]:
        calls.clear()
        engine.forward_microbatch(step, members)
        assert calls and set(calls) == {expected}, (engine.config.experts_backend, calls)
    calls.clear()
    loop.run(step)
    assert calls and set(calls) == {"loop_experts"}


def test_recompute_blocks_auto_is_every_block_until_the_search_sets_the_fewest_that_fit(step, monkeypatch):
    """An engine built with recompute_blocks auto recomputes every block until `fit_recompute_blocks`, which probes
    untimed steps (out of memory below 3 blocks, simulated), sets the fewest that fit and returns the search's
    record; on the CPU, which has no device total, the search is refused."""
    from harts import engine as engine_module
    from harts import engine_memory

    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    engine = Engine.build(model, ExecutionConfig(recompute=True, recompute_blocks="auto", capacity=300,
                                                 memory_margin=0.25), "cpu", execution="compact")
    assert engine.search_pending and engine.config.recompute_blocks == 4
    planned = engine.plan(step)
    with pytest.raises(ValueError, match="recompute_blocks auto searches a GPU's memory: the model is on cpu"):
        engine.fit_recompute_blocks(step, planned)
    run_step_of = engine_module.run_step
    ran = []

    def simulated(model, step, microbatches, config, **kwargs):
        ran.append(config.recompute_blocks)
        if config.recompute_blocks < 3:
            raise torch.OutOfMemoryError("simulated")
        return run_step_of(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", simulated)
    monkeypatch.setattr(engine_memory, "device_memory_bytes", lambda device: 1 << 50)
    announced = []
    search = engine.fit_recompute_blocks(step, planned, reserved_bytes=7, on_probe=announced.append)
    assert announced == ran == [4, 1, 2, 3]
    assert search["recompute_blocks"] == 3 and [p["fits"] for p in search["probes"]] == [True, False, False, True]
    assert (search["memory_margin"], search["reserved_bytes"]) == (0.25, 7)
    assert search["memory_limit_bytes"] == (1 << 50) - (1 << 48) - 7
    assert engine.config.recompute_blocks == 3 and not engine.search_pending
    assert all(p.grad is None for p in model.parameters())  # the probes' gradients freed
    engine.run(step, planned)
    assert ran[-1] == 3
    assert search["extents"] == [list(extent) for extent in engine.extents(step, planned)]
    assert engine.unsearched_extent(step, planned) is None


def test_a_step_outside_the_searched_microbatches_is_searched_again_from_the_blocks_found(step, monkeypatch):
    """After a search on small microbatches, a plan of larger ones is not covered (`unsearched_extent`: the first
    microbatch that no searched one covers in rows, KDA rows and key/value rows); searching it tries the blocks found
    first and bisects above them only, and then both plans are covered."""
    from harts import engine as engine_module
    from harts import engine_memory

    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    knobs = ExecutionConfig(recompute=True, recompute_blocks="auto", capacity=300)
    engine = Engine.build(model, knobs, "cpu", execution="compact")
    small = engine.plan(step)
    large = plan_step(step, replace(knobs, capacity=1024, recompute_blocks=4).resolved("cpu", "compact"))
    run_step_of = engine_module.run_step
    ran = []

    def simulated(model, step, microbatches, config, **kwargs):
        # More rows need more blocks: 2 for the small plan's microbatches, 4 for the large plan's.
        ran.append(config.recompute_blocks)
        if config.recompute_blocks < (4 if len(microbatches) < len(small.microbatches) else 2):
            raise torch.OutOfMemoryError("simulated")
        return run_step_of(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", simulated)
    monkeypatch.setattr(engine_memory, "device_memory_bytes", lambda device: 1 << 50)
    assert engine.unsearched_extent(step, large) is None  # nothing searched yet
    assert engine.fit_recompute_blocks(step, small)["recompute_blocks"] == 2 and ran == [4, 1, 2]
    assert engine.unsearched_extent(step, small) is None
    outside = engine.unsearched_extent(step, large)
    assert outside in engine.extents(step, large) and outside[0] > max(engine.extents(step, small))[0]
    ran.clear()
    again = engine.fit_recompute_blocks(step, large)
    assert again["recompute_blocks"] == 4 and ran == [2, 4, 3]
    assert engine.searched_extents == engine.extents(step, small) + engine.extents(step, large)
    assert engine.unsearched_extent(step, small) is None and engine.unsearched_extent(step, large) is None
    ran.clear()
    assert engine.fit_recompute_blocks(step, small)["recompute_blocks"] == 4 and ran == [4]  # never fewer


def test_an_engine_built_with_given_blocks_does_not_search():
    model = HybridModel(load_model_config("tiny"))
    engine = Engine.build(model, ExecutionConfig(recompute=True, recompute_blocks="auto"), "cpu", execution="compact",
                          recompute_blocks=2)
    assert not engine.search_pending and engine.config.recompute_blocks == 2
    engine = Engine.build(model, ExecutionConfig(recompute=True, recompute_blocks=1), "cpu", execution="compact")
    assert not engine.search_pending and engine.config.recompute_blocks == 1


def _tiny_model():
    torch.manual_seed(0)
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    return model


TARGETS = {"step's": lambda step: None, "array": lambda step: semantic_targets_from_step(step).targets,
           "tensor": lambda step: torch.from_numpy(semantic_targets_from_step(step).targets)}


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("execution", ["compact", "baseline"])
def test_a_microbatch_is_microbatch_logprobs_on_its_layout(step, execution, targets):
    """`forward_microbatch` gives `microbatch_logprobs` of `build_layout`'s rows and the step's targets, whichever
    way they are given: the same log-probs, entropies, MoE losses and routing, and bitwise the same gradients."""
    model = _tiny_model()
    engine = Engine.build(model, ExecutionConfig(), "cpu", execution=execution)
    members = np.array([1, 4, 5, 8])
    out = engine.forward_microbatch(step, members, TARGETS[targets](step), temperature=0.7, return_entropy=True)
    (out.logprobs_S.sum() + out.entropy_S.sum() + out.moe_loss).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    index = PrefixIndex.from_step(step) if execution == "compact" else None
    layout = build_layout(step, members, model, engine.config, index)
    sem = semantic_index(step, members)
    logprobs, entropy, moe, auxes = microbatch_logprobs(
        model, layout, torch.from_numpy(semantic_targets_from_step(step).targets[sem]), engine.config,
        torch.device("cpu"), temperature=0.7, return_entropy=True)
    (logprobs.sum() + entropy.sum() + moe).backward()
    assert np.array_equal(out.semantic_index, sem) and out.num_rows == layout.num_rows
    assert torch.equal(out.logprobs_S, logprobs) and torch.equal(out.entropy_S, entropy)
    assert torch.equal(out.moe_loss, moe) and len(out.auxes) == len(auxes) > 0
    for a, b in zip(out.auxes, auxes):
        assert torch.equal(a.tokens_per_expert_E, b.tokens_per_expert_E)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_a_microbatch_over_the_capacity_is_refused_before_the_model_runs(step):
    model = _tiny_model()
    engine = Engine.build(model, ExecutionConfig(), "cpu", execution="compact")
    members = np.arange(step.num_trajectories)
    rows = engine.layout(step, members).num_rows
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(OverCapacity, match=rf"{rows:,} rows \(compact execution\) in one microbatch, more than the "
                                           rf"capacity {rows - 1:,}$"):
        engine.forward_microbatch(step, members, capacity=rows - 1)
    assert not calls
    assert engine.forward_microbatch(step, members, capacity=rows).num_rows == rows and calls


def test_balance_counts_are_each_microbatch_routing_summed(step):
    """The load-balancing counts of a forward without gradients of each microbatch, summed per MoE layer."""
    model = _tiny_model()
    engine = Engine.build(model, ExecutionConfig(capacity=300), "cpu", execution="compact")
    planned = engine.plan(step)
    assert planned.num_microbatches > 1
    counts = engine.balance_counts(step, planned.microbatches, index=planned.index)
    expected = None
    for members in planned.microbatches:
        layout = build_layout(step, members, model, engine.config, planned.index)
        _, auxes = model(layout.input_ids, layout)
        each = [aux.balance_counts_E.detach() for aux in auxes]
        expected = each if expected is None else [a + b for a, b in zip(expected, each)]
    num_moe = sum(block.is_moe for block in model.blocks)
    assert len(counts) == len(expected) == num_moe and not any(c.requires_grad for c in counts)
    assert all(torch.equal(a, b) for a, b in zip(counts, expected))
    assert all(float(c.sum()) == 0 for c in engine.balance_counts(step, []))


@pytest.mark.parametrize("statistics", [True, False], ids=["statistics", "no-statistics"])
def test_balance_counts_of_a_model_without_its_own_balance_loss(step, statistics):
    """With the layers' load-balancing loss off, the counts come from `moe.balance_statistics` (transformers' pooled
    reading); without either, a ValueError before the model runs (it read None before)."""
    config = load_model_config("tiny")
    model = HybridModel(replace(config, moe=replace(config.moe, aux_loss_coeff=0.0, balance_statistics=statistics)))
    model.init_weights(0)
    engine = Engine.build(model, ExecutionConfig(capacity=300), "cpu", execution="compact")
    planned = engine.plan(step)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    if not statistics:
        with pytest.raises(ValueError, match="do not report their load-balancing counts"):
            engine.balance_counts(step, planned.microbatches, index=planned.index)
        assert not calls
        return
    counts = engine.balance_counts(step, planned.microbatches, index=planned.index)
    top_k = config.moe.top_k
    assert [float(c.sum()) for c in counts] == [top_k * step.num_semantic_tokens] * len(counts)


def test_a_layout_is_build_layouts_with_the_index_built_when_not_given(step):
    model = _tiny_model()
    members = np.array([0, 2, 3])
    for execution in ("compact", "baseline"):
        engine = Engine.build(model, ExecutionConfig(), "cpu", execution=execution)
        expected = build_layout(step, members, model, engine.config, PrefixIndex.from_step(step))
        assert engine.layout(step, members).info == expected.info


def test_the_library_pages_example_runs(capsys):
    """docs/library.md's "The engine" example: a planned step, then one microbatch's log-probs."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs/library.md").read_text(encoding="utf-8")
    section = text.split("\n## The engine\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    exec(compile(code, "docs/library.md (The engine)", "exec"), {})
    printed = capsys.readouterr().out
    rows, tokens, count = map(int, re.search(r"(\d+) rows for (\d+) tokens in (\d+) microbatches", printed).groups())
    assert rows < tokens and count > 1
    first, logprobs = map(int, re.search(r"first microbatch: (\d+) rows, (\d+) log-probs", printed).groups())
    assert first < logprobs
