"""Cost Evaluator: hardware/model/cluster presets, rollout and training time/memory models, calibration."""

from areal_libra.cost.presets import (
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    PresetError,
    load_cluster,
    load_hardware,
    load_model,
)
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import BatchStats, TrainCost, TrainParallel

__all__ = ["BatchStats", "ClusterSpec", "HardwareSpec", "ModelSpec", "PresetError", "RolloutCost", "TrainCost",
           "TrainParallel", "load_cluster", "load_hardware", "load_model"]
