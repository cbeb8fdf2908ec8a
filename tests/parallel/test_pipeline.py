"""1F1B order: every microbatch forward then backward on every stage, bounded in-flight work, no deadlock.

The deadlock check simulates the point-to-point protocol of PipelineLink: a send never blocks, a
stage's forward j (j's activations from the previous stage) and backward j (j's gradient from the
next stage) wait for their message; the run must finish for every stage/microbatch count.
"""

import pytest

from harts.parallel.pipeline import one_f_one_b


def _simulate(num_stages: int, num_microbatches: int) -> None:
    orders = [one_f_one_b(num_microbatches, s, num_stages) for s in range(num_stages)]
    position = [0] * num_stages
    sent = set()
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if position[s] == len(orders[s]):
                continue
            kind, j = orders[s][position[s]]
            if kind == "F":
                needs = ("act", s - 1, j) if s > 0 else None
            else:
                needs = ("grad", s + 1, j) if s < num_stages - 1 else None
            if needs is None or needs in sent:
                sent.add(("act" if kind == "F" else "grad", s, j))
                position[s] += 1
                progressed = True
        assert progressed, f"deadlock at {position} for {num_stages} stages, {num_microbatches} microbatches"


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8])
def test_one_f_one_b(num_stages, num_microbatches):
    for stage in range(num_stages):
        order = one_f_one_b(num_microbatches, stage, num_stages)
        everything = [(kind, j) for kind in "FB" for j in range(num_microbatches)]
        assert sorted(order) == sorted(everything)
        forwards = [j for kind, j in order if kind == "F"]
        backwards = [j for kind, j in order if kind == "B"]
        assert forwards == backwards == list(range(num_microbatches))
        in_flight = peak = 0
        for kind, _ in order:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
            assert in_flight >= 0
        assert peak <= min(num_stages - stage, num_microbatches)
    _simulate(num_stages, num_microbatches)


def test_single_stage_is_the_single_process_order():
    assert one_f_one_b(3, 0, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_recompute_blocks_count_per_stage(pp):
    """`recompute_blocks` = N recomputes the first N blocks of every pipeline stage (Megatron's block method)."""
    from harts.parallel.model import stage_blocks, stage_recompute_limit

    for rank in range(pp):
        blocks = stage_blocks(8, pp, rank)
        limit = stage_recompute_limit(blocks, 2)
        assert [b for b in blocks if b < limit] == blocks[:2]
        assert stage_recompute_limit(blocks, None) is None
