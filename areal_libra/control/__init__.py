"""Libra's control loop (planner re-solve with the gain > cost gate, elastic pool with persistence), one
implementation driving both the simulator and the live run through the `Cluster` interface."""

from areal_libra.control.controller import (
    Cluster,
    ControlConfig,
    ControlEvent,
    LibraController,
    PlanSource,
    PoolView,
    StepObservation,
)
from areal_libra.control.profile import PROFILE_GROUPS, ProfileError, ProfilePass, first_plan

__all__ = ["PROFILE_GROUPS", "ProfileError", "ProfilePass", "first_plan", "Cluster", "ControlConfig", "ControlEvent", "LibraController", "PlanSource", "PoolView",
           "StepObservation"]
