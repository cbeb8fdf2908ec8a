"""Rank layout: a brute-force enumeration of megatron's rank formula, and megatron-core's own RankGenerator."""

import itertools

import pytest

from harts.config import shipped_configs
from harts.parallel.config import ParallelConfig, load_parallel_config
from harts.parallel.groups import rank_layout

SHIPPED = sorted(shipped_configs("parallel"))
EXTRA = [
    ParallelConfig(name="dp2-tp2-sp-ep4", dp=2, tp=2, sequence_parallel=True, ep=4),
    ParallelConfig(name="dp4-ep2-pp2", dp=4, ep=2, pp=2),
    ParallelConfig(name="dp3-tp2-pp2", dp=3, tp=2, pp=2),
]


def _configs():
    return [load_parallel_config(name) for name in SHIPPED] + EXTRA


def _brute_force(config: ParallelConfig) -> dict[int, dict[str, tuple]]:
    """Coordinates by the formula rank = tp_rank + tp·(dp_rank + dp·pp_rank), groups by equal other coordinates."""
    coords = {}
    for pp, dp, tp in itertools.product(range(config.pp), range(config.dp), range(config.tp)):
        rank = tp + config.tp * (dp + config.dp * pp)
        local = tp + config.tp * dp
        etp, rest = local % config.expert_tp, local // config.expert_tp
        coords[rank] = dict(pp=pp, dp=dp, tp=tp, etp=etp, ep=rest % config.ep, edp=rest // config.ep)
    varying = {"tp": ("tp",), "dp": ("dp",), "pp": ("pp",), "ep": ("ep",), "edp": ("edp",), "etp": ("etp",)}
    dense, expert = ("pp", "dp", "tp"), ("pp", "edp", "ep", "etp")
    groups = {}
    for rank, c in coords.items():
        groups[rank] = {}
        for name, (dim,) in varying.items():
            keys = dense if dim in dense else expert
            members = [r for r, o in coords.items() if all(o[k] == c[k] for k in keys if k != dim)]
            groups[rank][name] = tuple(sorted(members, key=lambda r: coords[r][dim]))
    return coords, groups


@pytest.mark.parametrize("config", _configs(), ids=lambda c: c.name)
def test_rank_layout_equals_brute_force(config):
    coords, groups = _brute_force(config)
    for rank in range(config.world_size):
        layout = rank_layout(config, rank)
        c = coords[rank]
        assert (layout.pp_rank, layout.dp_rank, layout.tp_rank, layout.ep_rank, layout.edp_rank) == (
            c["pp"], c["dp"], c["tp"], c["ep"], c["edp"])
        assert {k: tuple(v) for k, v in layout.groups.items()} == groups[rank]
        assert rank in layout.groups["ep"] and len(layout.groups["ep"]) == config.ep


def test_ep_groups_fold_onto_dp_and_tp():
    """dp2-ep2: the EP group is the DP group; ep2 (tp2-sp): it is the TP group; no expert-DP reduction."""
    for name, same_as in (("dp2-ep2", "dp"), ("ep2", "tp")):
        layout = rank_layout(load_parallel_config(name), 0)
        assert layout.groups["ep"] == layout.groups[same_as] == [0, 1]
        assert layout.groups["edp"] == [0]


def test_bad_rank():
    with pytest.raises(ValueError, match="rank 2 outside world of 2"):
        rank_layout(load_parallel_config("dp2"), 2)


@pytest.mark.slow
@pytest.mark.parametrize("config", _configs(), ids=lambda c: c.name)
def test_rank_layout_equals_megatron(config):
    """megatron-core 0.16's RankGenerator (what initialize_model_parallel builds its groups from)."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=config.tp, ep=1, dp=config.dp, pp=config.pp, cp=1, order=order)
    expert = RankGenerator(tp=config.expert_tp, ep=config.ep, dp=config.expert_dp, pp=config.pp, cp=1, order=order)
    wanted = {"tp": dense.get_ranks("tp"), "dp": dense.get_ranks("dp"), "pp": dense.get_ranks("pp"),
              "ep": expert.get_ranks("ep"), "edp": expert.get_ranks("dp"), "etp": expert.get_ranks("tp")}
    for rank in range(config.world_size):
        layout = rank_layout(config, rank)
        for name, groups in wanted.items():
            (mine,) = [g for g in groups if rank in g]
            assert layout.groups[name] == list(mine), (config.name, rank, name)
