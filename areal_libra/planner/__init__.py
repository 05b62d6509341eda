"""Global Resource Planner: training decision tree, rollout DP, joint split search, re-plan policy."""

from areal_libra.planner.evaluate import PlanPrice, price
from areal_libra.planner.solve import sample_history, solve
from areal_libra.planner.types import Interval, Plan, PlanError, PlannerConfig, RolloutInstance

__all__ = ["Interval", "Plan", "PlanError", "PlanPrice", "PlannerConfig", "RolloutInstance", "price", "sample_history",
           "solve"]
