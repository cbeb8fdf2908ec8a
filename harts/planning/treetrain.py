"""The "treetrain-ortools" baseline: Tree Training's planner as the HARTS paper describes it.

Tree Training's planner code is not public. The paper says its OR-Tools scheme "first assigns
data replicas by FFD, then partitions within each replica independently, and cannot jointly
optimise the slot's synchronisation critical path" (DESIGN §2). This module implements that
description; where it leaves a choice open, `TreeTrainConfig` offers the readings, and the
DEFAULT is the literal one (replica_assignment="ffd", slot_order="solver"), which is what the
planning table (`harts bench planning`, reports/planning.*) uses unless told otherwise (the command-line flags
of those readings: `add_treetrain_options`, `treetrain_options`):

1. Parts. Each rollout tree (`step.trees`) whose own trie fits in T is one part. A larger tree
   is split into its root-level subtrees: the children of its root segment (the groups of its
   trajectories that agree beyond the tree's common prefix), each part carrying the root
   prefix, plus one part per trajectory that ends exactly at the root fork. A part still larger
   than T is split the same way one level further, recursively (a single trajectory always
   fits: longer ones are rejected before planning).
2. Replicas (`replica_assignment`). Parts in decreasing compact size (ties: lowest first rank).
   - "ffd" (default): first-fit-decreasing into D replicas of capacity ⌈Σ part sizes / D⌉:
     each part goes to the FIRST replica (lowest index) whose load plus the part's size is at
     most that capacity. A part that fits no replica goes to the least-loaded one (ties: lowest
     replica); `details["overflow_parts"]` counts them. The capacity is the smallest that could
     hold every part; parts are priced alone (sharing between parts is not known at this stage).
     The first replicas take the largest parts, the last ones many small parts, so the replicas
     need different microbatch counts and 4 splits parts on those that need fewer.
   - "lpt": each part to the least-loaded replica (ties: lowest replica), the longest-processing-
     time rule; the most favourable reading of "FFD" for balance (the planner before these
     options).
3. Microbatches, per replica, independently: an OR-Tools CP-SAT model. Items = the replica's
   parts, bins = the count of a trie-aware first-fit-decreasing packing (an upper bound, also
   the solution hint). Sharing is modelled exactly with the step's segment tree: a segment
   traversed by one part only is a constant of that part; segments traversed by several of
   the replica's parts are grouped by their part set into nodes n with y[n, b] >= x[p, b], so
   bin work = Σ_n len_n·y[n, b] + Σ_p own_p·x[p, b] <= T is the bin's trie size (parts of one
   tree share their root prefix, parts of different trees the common scaffold prefix, and
   deeper shared prefixes count too). Objective: minimise (Σ_b work_b)·(B + 1) + Σ_b used_b,
   i.e. compact tokens first, then microbatch count. Symmetry: part i (in decreasing size)
   may only use bins 0..i, and used bins come first. Limits: `time_limit_s` wall-clock seconds
   per solve (default 10), `num_workers` (default 2, this CPU machine's core count), seed 0.
   If a solve returns no solution, the hint is used (its status is recorded).
4. K mod D. Every slot needs one microbatch per replica, so each replica must end with the same
   count k* = max over replicas (Tree Training's own replicas need not; this is the adaptation
   to our slot model, without empty microbatches). A replica with fewer than k* trajectories
   first receives parts from the replica with the most trajectories (its smallest part, split
   into root-level subtrees until it fits that replica's surplus over k*). Every replica with
   fewer than k* bins, or that gave or received parts, is solved again with exactly k*
   non-empty bins (same objective), its parts split one more level while it has fewer than k*
   parts; the hint is its earlier solution adjusted for the moves, bins split until there are
   k*. If the step has fewer than D·k* trajectories no such plan exists: a ValueError.
5. Slots (`slot_order`): slot s takes each replica's s-th microbatch.
   - "solver" (default): each replica's microbatches in the order the CP-SAT model numbers its
     bins (of its last solve; the hint's numbering when a solve returned no solution). Nothing
     aligns heavy with heavy across replicas, as the paper says of this scheme; the symmetry
     breaking of 3 puts each replica's largest part in its bin 0, so the order is not random.
   - "sorted": each replica's microbatches in decreasing work (ties: lowest first rank), the
     alignment that minimises Σ slot maxima for fixed replica contents: a slot-aware step the
     paper says this scheme does not take (the planner before these options).

Records (`Plan.details`): the readings, `time_limit_s`, `num_parts`, `replica_capacity` and
`overflow_parts` (ffd; None under lpt), `replica_part_sizes` (Σ part sizes per replica as
assigned, before any lending), per replica its solve (`replicas[r]`) and its count-equalising
re-solve (`replicas[r]["equalised"]`), each with `status` (CP-SAT's status name; "EMPTY" for a
replica without parts, not solved), `seconds` (wall time of the model's construction and
solve), `solver_seconds` (CP-SAT's own wall time), `optimal` (status OPTIMAL: proven) and
`stopped_by_limit` (status FEASIBLE or UNKNOWN: only the time limit stops CP-SAT before a proof,
as no other limit is set), and `solve_summary` = {solves, optimal, stopped_by_limit} over the
plan's CP-SAT solves.

`plan_seconds` is the wall time of everything above, the CP-SAT solves included. With a wall-
clock limit and several workers CP-SAT is not bit-reproducible; the plan is still validated.

Tested against (tests/planning/test_treetrain.py): exact replica contents of FFD (capacity,
first fit, the overflow rule) and LPT on hand-built part sizes, exact slot contents of both slot
orders on a hand-built step, the sharing model against the trie on random part sets, CP-SAT's
optimum against enumeration of every partition of a few parts, and the validator.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from harts.args import positive_float
from harts.extras import require
from harts.planning.plans import Plan, build_plan
from harts.planning.rank_work import RankWork
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex


REPLICA_ASSIGNMENTS = ("ffd", "lpt")
SLOT_ORDERS = ("solver", "sorted")


@dataclass(kw_only=True)
class TreeTrainConfig:
    replica_assignment: str = "ffd"
    """Parts to replicas: "ffd" (first fit, replica capacity ⌈Σ part sizes / D⌉; the paper's) or "lpt"
    (least-loaded replica)."""
    slot_order: str = "solver"
    """Each replica's microbatches: "solver" (CP-SAT's bin order; the paper's) or "sorted" (decreasing work)."""
    time_limit_s: float = 10.0
    """CP-SAT wall-clock limit per solve (one per replica, plus one per count-equalising re-solve)."""
    num_workers: int = 2
    """CP-SAT search workers."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_limit_s) and self.time_limit_s > 0) or self.num_workers < 1:
            raise ValueError(f"time_limit_s must be a finite number > 0 and num_workers >= 1, got {self}")
        if self.replica_assignment not in REPLICA_ASSIGNMENTS:
            raise ValueError(f"treetrain-ortools: replica_assignment must be one of {', '.join(REPLICA_ASSIGNMENTS)}, "
                             f"got {self.replica_assignment!r}")
        if self.slot_order not in SLOT_ORDERS:
            raise ValueError(f"treetrain-ortools: slot_order must be one of {', '.join(SLOT_ORDERS)}, "
                             f"got {self.slot_order!r}")


# The command-line flags of TreeTrainConfig (harts plan microbatches, harts bench planning): flag -> field
_TREETRAIN_FLAGS = {"--time-limit": "time_limit_s", "--replica-assignment": "replica_assignment",
                    "--slot-order": "slot_order"}


def add_treetrain_options(parser: argparse.ArgumentParser) -> None:
    """--time-limit, --replica-assignment and --slot-order, each None unless given."""
    parser.add_argument("--time-limit", type=positive_float, default=None,
                        help="treetrain-ortools: CP-SAT seconds per solve (default 10)")
    parser.add_argument("--replica-assignment", choices=REPLICA_ASSIGNMENTS, default=None,
                        help="treetrain-ortools: parts to replicas by first-fit-decreasing with replica capacity "
                             "ceil(total/D) (ffd, default: the paper's description) or to the least-loaded replica "
                             "(lpt)")
    parser.add_argument("--slot-order", choices=SLOT_ORDERS, default=None,
                        help="treetrain-ortools: each replica's microbatches in CP-SAT's bin order (solver, default: "
                             "the paper's description) or by decreasing work (sorted)")


def treetrain_options(args: argparse.Namespace, planners: list[str]) -> dict[str, object]:
    """The TreeTrainConfig fields given on the command line; an error if `planners` lacks treetrain-ortools."""
    options = {}
    for flag, name in _TREETRAIN_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if "treetrain-ortools" not in planners:
            raise ValueError(f"{flag} applies to the treetrain-ortools planner only")
        options[name] = value
    return options


def plan_treetrain_ortools(step: Step, capacity: int, dp: int, *, index: PrefixIndex | None = None,
                           config: TreeTrainConfig | None = None, **options) -> Plan:
    started = time.perf_counter()
    config = config or TreeTrainConfig()
    names = {f.name for f in fields(TreeTrainConfig)}
    if set(options) - names:
        raise ValueError(f"treetrain-ortools: unknown option '{sorted(set(options) - names)[0]}' "
                         f"(allowed: {', '.join(sorted(names))})")
    config = replace(config, **options) if options else config
    index = index or PrefixIndex.from_step(step)
    rw = RankWork(index)
    parts = _tree_parts(step, rw, capacity)
    part_nodes = _Sharing(index, rw)

    sizes = [rw.trie(p) for p in parts]
    order = sorted(range(len(parts)), key=lambda i: (-sizes[i], parts[i][0]))
    members, replica_capacity, overflow = _assign_replicas([sizes[i] for i in order], dp, config.replica_assignment)
    replica_parts = [[parts[order[i]] for i in held] for held in members]

    solutions: list[list[list[int]]] = []
    details: dict[str, object] = {
        "replica_assignment": config.replica_assignment, "slot_order": config.slot_order,
        "time_limit_s": config.time_limit_s, "num_parts": len(parts), "replica_capacity": replica_capacity,
        "overflow_parts": overflow, "replica_part_sizes": [sum(sizes[order[i]] for i in held) for held in members],
        "replicas": [],
    }
    for r in range(dp):
        bins, info = _solve_replica(rw, part_nodes, replica_parts[r], capacity, config, count=None)
        solutions.append(bins)
        details["replicas"].append(info)
    target = max(len(b) for b in solutions)
    hints = [[list(b) for b in bins] for bins in solutions]
    moved = _lend_trajectories(rw, replica_parts, hints, target)
    for r in range(dp):
        if len(solutions[r]) == target and r not in moved:
            continue
        current = replica_parts[r]
        while len(current) < target:
            widest = max((p for p in current if len(p) >= 2), key=lambda p: (len(p), -p[0]))
            current = [q for p in current for q in (rw.root_subtrees(p) if p is widest else [p])]
        bins, info = _solve_replica(rw, part_nodes, current, capacity, config, count=target, hint=hints[r])
        solutions[r] = bins
        details["replicas"][r]["equalised"] = info
    details["lent_to"] = {str(r): sorted(donors) for r, donors in moved.items() if donors}
    solves = [info for entry in details["replicas"] for info in (entry, entry.get("equalised"))
              if info is not None and info["status"] != "EMPTY"]
    details["solve_summary"] = {"solves": len(solves), "optimal": sum(s["optimal"] for s in solves),
                                "stopped_by_limit": sum(s["stopped_by_limit"] for s in solves)}

    groups, works, slot, replica = [], [], [], []
    for r, bins in enumerate(solutions):
        bin_works = [rw.trie(b) for b in bins]
        sequence = (range(len(bins)) if config.slot_order == "solver"
                    else sorted(range(len(bins)), key=lambda k: (-bin_works[k], bins[k][0])))
        for position, k in enumerate(sequence):
            groups.append(rw.order[np.asarray(bins[k], dtype=np.int64)])
            works.append(bin_works[k])
            slot.append(position)
            replica.append(r)
    return build_plan(step, groups, np.asarray(works), planner="treetrain-ortools", capacity=capacity, dp=dp,
                      started=started, slot=np.asarray(slot), replica=np.asarray(replica), details=details)


def _assign_replicas(sizes: list[int], dp: int, rule: str) -> tuple[list[list[int]], int | None, int | None]:
    """Items (indices into `sizes`, taken in the given order: decreasing size) per replica.

    "ffd": each item to the first replica with room under the capacity ⌈Σ sizes / D⌉, an item
    that fits nowhere to the least-loaded replica; "lpt": each item to the least-loaded replica
    (ties: lowest replica). Returns (items per replica, the capacity, the items that fit nowhere);
    the last two are None under "lpt".
    """
    loads = [0] * dp
    members: list[list[int]] = [[] for _ in range(dp)]
    capacity = -(-sum(sizes) // dp) if rule == "ffd" else None
    overflow = 0 if rule == "ffd" else None
    for i, size in enumerate(sizes):
        r = None
        if rule == "ffd":
            r = next((j for j in range(dp) if loads[j] + size <= capacity), None)
            overflow += r is None
        if r is None:
            r = min(range(dp), key=lambda j: (loads[j], j))
        loads[r] += size
        members[r].append(i)
    return members, capacity, overflow


def _lend_trajectories(rw: RankWork, replica_parts: list[list[list[int]]], hints: list[list[list[int]]],
                       target: int) -> dict[int, set[int]]:
    """Give each replica at least `target` trajectories by moving parts from the replicas with the
    most, smallest part first (split into root-level subtrees until it fits the donor's surplus).
    Updates parts and hint bins in place; returns {replica: donors} for every replica touched."""
    touched: dict[int, set[int]] = {}
    count = [sum(len(p) for p in parts) for parts in replica_parts]
    for r in range(len(replica_parts)):
        while count[r] < target:
            donors = [d for d in range(len(replica_parts)) if count[d] > target]
            if not donors:
                raise ValueError(
                    f"treetrain-ortools: {sum(count)} trajectories cannot fill {target} microbatches on each of "
                    f"{len(replica_parts)} replicas (K mod D = 0 without empty microbatches)"
                )
            donor = max(donors, key=lambda d: (count[d], -d))
            parts = replica_parts[donor]
            part = min(parts, key=lambda p: (rw.trie(p), p[0]))
            while len(part) > count[donor] - target:
                parts.remove(part)
                parts.extend(rw.root_subtrees(part))
                part = min(parts, key=lambda p: (rw.trie(p), p[0]))
            parts.remove(part)
            replica_parts[r].append(part)
            count[donor] -= len(part)
            count[r] += len(part)
            hints[donor] = [kept for b in hints[donor] if (kept := [x for x in b if x not in part])]
            hints[r].append(list(part))
            touched.setdefault(r, set()).add(donor)
            touched.setdefault(donor, set())
    return touched


def _tree_parts(step: Step, rw: RankWork, capacity: int) -> list[list[int]]:
    """Whole trees, or recursively their root-level subtrees, each within the capacity."""
    trees: dict[str, list[int]] = {}
    for trajectory, tree in enumerate(step.trees):
        trees.setdefault(tree, []).append(int(rw.rank[trajectory]))
    parts = []
    pending = [sorted(members) for _, members in sorted(trees.items())]
    while pending:
        ranks = pending.pop()
        if rw.trie(ranks) <= capacity:
            parts.append(ranks)
        else:
            pending.extend(reversed(rw.root_subtrees(ranks)))
    return sorted(parts)


class _Sharing:
    """Segments of the step's trie on each trajectory's path, to price sets of parts exactly."""

    def __init__(self, index: PrefixIndex, rw: RankWork) -> None:
        tree = index.segment_tree()
        owners, segments = tree.member_paths()
        self.lengths = tree.segment_lengths
        ranks = index.rank[tree.members[owners]]
        order = np.argsort(ranks, kind="stable")
        self.ranks = ranks[order]
        self.segments = segments[order]
        self.starts = np.searchsorted(self.ranks, np.arange(rw.num + 1))

    def nodes(self, parts: list[list[int]]) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """(own_p, [(len_n, parts through n)]) for segments shared by several parts."""
        through: dict[int, set[int]] = {}
        for p, ranks in enumerate(parts):
            for r in ranks:
                for s in self.segments[self.starts[r] : self.starts[r + 1]].tolist():
                    through.setdefault(s, set()).add(p)
        own = [0] * len(parts)
        grouped: dict[tuple[int, ...], int] = {}
        for s, members in through.items():
            if len(members) == 1:
                own[next(iter(members))] += int(self.lengths[s])
            else:
                key = tuple(sorted(members))
                grouped[key] = grouped.get(key, 0) + int(self.lengths[s])
        return own, [(length, list(key)) for key, length in sorted(grouped.items())]


def _solve_replica(rw: RankWork, sharing: _Sharing, parts: list[list[int]], capacity: int,
                   config: TreeTrainConfig, *, count: int | None,
                   hint: list[list[int]] | None = None) -> tuple[list[list[int]], dict[str, object]]:
    """CP-SAT partition of one replica's parts; `count` fixes the number of non-empty bins."""
    cp_model = require("ortools.sat.python.cp_model", "the TreeTrain planner (CP-SAT)")

    solve_started = time.perf_counter()
    if not parts:
        return [], {"parts": 0, "bins": 0, "status": "EMPTY", "seconds": 0.0, "solver_seconds": 0.0,
                    "optimal": False, "stopped_by_limit": False}
    sizes = [rw.trie(p) for p in parts]
    order = sorted(range(len(parts)), key=lambda i: (-sizes[i], parts[i][0]))
    parts = [parts[i] for i in order]
    own, nodes = sharing.nodes(parts)
    part_nodes: list[list[int]] = [[] for _ in parts]
    for n, (_, members) in enumerate(nodes):
        for p in members:
            part_nodes[p].append(n)

    if hint is None:
        assignment = _first_fit(own, nodes, part_nodes, capacity)
    else:
        assignment = _hint_assignment(parts, hint, count)
    num_bins = count if count is not None else max(assignment) + 1

    model = cp_model.CpModel()
    x = [{b: model.new_bool_var(f"x{p}_{b}") for b in range(min(p + 1, num_bins))} for p in range(len(parts))]
    used = [model.new_bool_var(f"used{b}") for b in range(num_bins)]
    y = [{} for _ in nodes]
    for p, row in enumerate(x):
        model.add_exactly_one(row.values())
        for b, var in row.items():
            model.add_implication(var, used[b])
            for n in part_nodes[p]:
                if b not in y[n]:
                    y[n][b] = model.new_bool_var(f"y{n}_{b}")
                model.add_implication(var, y[n][b])
    for b in range(num_bins - 1):
        model.add_implication(used[b + 1], used[b])
    works = []
    for b in range(num_bins):
        work = sum(nodes[n][0] * row[b] for n, row in enumerate(y) if b in row)
        work += sum(own[p] * row[b] for p, row in enumerate(x) if b in row)
        model.add(work <= capacity)
        works.append(work)
        if count is not None:
            model.add(sum(row[b] for row in x if b in row) >= 1)
    model.minimize(sum(works) * (num_bins + 1) + sum(used))
    for p, row in enumerate(x):
        for b, var in row.items():
            model.add_hint(var, int(assignment[p] == b))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = config.time_limit_s
    solver.parameters.num_workers = config.num_workers
    solver.parameters.random_seed = config.seed
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assignment = [next(b for b, var in row.items() if solver.boolean_value(var)) for row in x]
    bins_of: dict[int, list[int]] = {}
    for p, b in enumerate(assignment):
        bins_of.setdefault(b, []).extend(parts[p])
    bins = [sorted(bins_of[b]) for b in sorted(bins_of)]
    assert all(rw.trie(b) <= capacity for b in bins)
    assert count is None or len(bins) == count
    return bins, {
        "parts": len(parts), "bins": len(bins), "status": solver.status_name(status),
        "seconds": round(time.perf_counter() - solve_started, 3), "solver_seconds": round(solver.wall_time, 3),
        "optimal": status == cp_model.OPTIMAL,
        # Only max_time_in_seconds can stop CP-SAT before it proves optimality or infeasibility.
        "stopped_by_limit": status in (cp_model.FEASIBLE, cp_model.UNKNOWN),
    }


def _first_fit(own: list[int], nodes: list[tuple[int, list[int]]], part_nodes: list[list[int]],
               capacity: int) -> list[int]:
    """Trie-aware first fit of parts (already in decreasing size) into bins."""
    covered: list[set[int]] = []
    loads: list[int] = []
    assignment = []
    for p in range(len(own)):
        for b in range(len(loads)):
            added = own[p] + sum(nodes[n][0] for n in part_nodes[p] if n not in covered[b])
            if loads[b] + added <= capacity:
                loads[b] += added
                covered[b].update(part_nodes[p])
                assignment.append(b)
                break
        else:
            loads.append(own[p] + sum(nodes[n][0] for n in part_nodes[p]))
            covered.append(set(part_nodes[p]))
            assignment.append(len(loads) - 1)
    return assignment


def _hint_assignment(parts: list[list[int]], hint: list[list[int]], count: int) -> list[int]:
    """Each part's bin in `hint` (bins of ranks), bins split until there are `count`, relabelled
    so that bins are numbered by their first part (the model's symmetry breaking)."""
    bin_of_rank = {r: b for b, members in enumerate(hint) for r in members}
    groups: dict[int, list[int]] = {}
    for p, ranks in enumerate(parts):
        groups.setdefault(bin_of_rank[ranks[0]], []).append(p)
    bins = [sorted(g) for g in groups.values()]
    assert len(bins) <= count
    while len(bins) < count:
        k = max(range(len(bins)), key=lambda i: (len(bins[i]), -i))
        assert len(bins[k]) >= 2
        bins[k:k + 1] = [bins[k][:1], bins[k][1:]]
    bins.sort(key=lambda g: g[0])
    assignment = [0] * len(parts)
    for b, members in enumerate(bins):
        for p in members:
            assignment[p] = b
    return assignment
