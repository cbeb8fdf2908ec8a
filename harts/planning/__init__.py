"""Planning: microbatch plans (DESIGN §2) and linear-attention call schedules (DESIGN §3)."""

from harts.planning.microbatch import PLANNER_NAMES, PlanMetrics, plan, plan_metrics, validate
from harts.planning.plans import Microbatch, Plan, greedy_assignment, objective

__all__ = [
    "PLANNER_NAMES",
    "Microbatch",
    "Plan",
    "PlanMetrics",
    "greedy_assignment",
    "objective",
    "plan",
    "plan_metrics",
    "validate",
]
