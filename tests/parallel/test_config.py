"""Parallel configs: every shipped YAML loads and fits the shipped models; bad degrees are one-line errors."""

from pathlib import Path

import pytest

from harts.config import shipped_configs
from harts.model.config import load_model_config
from harts.parallel.config import ParallelConfig, load_parallel_config

SHIPPED = sorted(shipped_configs("parallel"))
REQUIRED = ("single", "dp2", "tp2", "tp2-sp", "pp2", "ep2", "dp2-ep2")


def test_required_configs_are_shipped():
    assert set(REQUIRED) <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_fits_the_models(name):
    config = load_parallel_config(name)
    assert config.name == name
    for model in ("tiny", "cpu-small"):
        config.check_model(load_model_config(model))


@pytest.mark.parametrize(
    ("name", "world", "expert_tp", "expert_dp"),
    [("single", 1, 1, 1), ("dp2", 2, 1, 2), ("tp2", 2, 2, 1), ("ep2", 2, 1, 1), ("dp2-ep2", 2, 1, 1),
     ("dp2-tp2-sp", 4, 2, 2), ("dp2-pp2-ep2", 4, 1, 1)],
)
def test_derived_sizes(name, world, expert_tp, expert_dp):
    config = load_parallel_config(name)
    assert (config.world_size, config.expert_tp, config.expert_dp) == (world, expert_tp, expert_dp)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(dp=0), "dp must be >= 1"),
        (dict(tp=1, sequence_parallel=True), "sequence_parallel needs tp > 1"),
        (dict(dp=3, ep=2), r"ep \(2\) must divide dp·tp \(3\)"),
        (dict(tp=2, ep=2), "needs sequence_parallel"),
        (dict(backend="mpi"), "backend must be one of"),
        (dict(timeout_s=0.0), "timeout_s must be > 0"),
    ],
    ids=["dp0", "sp-without-tp", "ep-not-dividing", "tp-ep-without-sp", "backend", "timeout"],
)
def test_bad_degrees(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(name="bad", **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(tp=4), r"kda.num_heads \(2\) not divisible by tp \(4\)"),
        (dict(dp=8, ep=8), r"moe.num_experts \(4\) not divisible by ep \(8\)"),
        (dict(pp=5), r"num_layers \(4\) < pp \(5\)"),
    ],
    ids=["heads", "experts", "layers"],
)
def test_model_does_not_split(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(name="bad", **fields).check_model(load_model_config("tiny"))


@pytest.mark.parametrize("backend, ep, refused", [("lean", 2, True), ("lean", 1, False), ("grouped", 2, False)],
                         ids=["lean-ep2", "lean-ep1", "grouped-ep2"])
def test_lean_experts_need_ep_1(backend, ep, refused):
    """Expert parallelism replaces the lean experts' fused dispatch and combine: refused before any rank runs."""
    from dataclasses import replace

    model = load_model_config("tiny")
    model = replace(model, moe=replace(model.moe, experts_backend=backend))
    config = ParallelConfig(name="ep", dp=2, ep=ep)
    if refused:
        with pytest.raises(ValueError, match=r"'lean' fuses the dispatch and combine .* \(ep = 2\)"):
            config.check_model(model)
    else:
        config.check_model(model)


def test_tied_embeddings_across_stages_are_not_implemented():
    from dataclasses import replace

    model = replace(load_model_config("tiny"), tie_embeddings=True)
    with pytest.raises(NotImplementedError, match="tie_embeddings with pp > 1"):
        ParallelConfig(name="pp2", pp=2).check_model(model)


def test_loader_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown parallel config 'nope'"):
        load_parallel_config("nope")
    path = tmp_path / "x.yaml"
    path.write_text("name: x\ntp: 2\nsequence_paralel: true\n")
    with pytest.raises(ValueError, match="unknown key 'sequence_paralel'"):
        load_parallel_config(str(path))
    path.write_text("name: x\ntp: two\n")
    with pytest.raises(ValueError, match="key 'tp': expected an integer"):
        load_parallel_config(str(path))
