"""Summary statistics of a step (`harts trees stats`).

`step_stats(step)` returns the dict printed by `harts trees stats --json`, with exactly the keys
of `STATS_KEYS`. Definitions (DESIGN §1): compression = S / C; segments = nodes of the segment
tree (split at forks and at trajectory ends); forks = segments with two or more children (a step
whose trajectories begin with different tokens is a forest: its roots are not a fork);
max_fork_depth = the most forks on any trajectory's path; length_percentiles = trajectory
lengths in tokens at p0 (min), p50, p90, p99 and p100 (max), nearest-rank.
"""

from __future__ import annotations

import numpy as np

from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

STATS_KEYS = (
    "trajectories", "trees", "semantic_tokens", "compact_tokens", "compression",
    "segments", "forks", "max_fork_depth", "length_percentiles",
)
PERCENTILES = (0, 50, 90, 99, 100)


def step_stats(step: Step, index: PrefixIndex | None = None) -> dict[str, object]:
    index = index or PrefixIndex.from_step(step)
    tree = index.segment_tree()
    fork_depth = tree.fork_depth()
    lengths = np.sort(step.lengths)
    percentiles = {
        f"p{p}": int(lengths[min(len(lengths) - 1, max(0, int(np.ceil(p / 100 * len(lengths))) - 1))])
        for p in PERCENTILES
    }
    return {
        "trajectories": step.num_trajectories,
        "trees": len(set(step.trees)),
        "semantic_tokens": step.num_semantic_tokens,
        "compact_tokens": tree.num_compact_tokens,
        "compression": step.num_semantic_tokens / tree.num_compact_tokens,
        "segments": tree.num_segments,
        "forks": int((tree.num_children >= 2).sum()),
        "max_fork_depth": int(fork_depth[tree.end_segment].max()),
        "length_percentiles": percentiles,
    }


def format_stats(stats: dict[str, object]) -> str:
    """Human-readable table of `step_stats` output."""
    lines = []
    for key in STATS_KEYS:
        value = stats[key]
        if key == "length_percentiles":
            value = "  ".join(f"{k}={v:,}" for k, v in value.items())
        elif key == "compression":
            value = f"{value:.3f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        lines.append(f"{key:<20} {value}")
    return "\n".join(lines)
