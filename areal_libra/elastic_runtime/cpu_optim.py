"""CPU-only training must not touch CUDA (the test bed's forked processes, the warm-up of its fork server).

torch.optim's step() starts with a graph-capture health check which, whenever CUDA is available, asks
for the current CUDA stream and so initialises CUDA. In a process forked from one that had initialised
CUDA that fails ("CUDA error: initialization error"); in any other CPU-only process it creates a CUDA
context for nothing, and poisons later forks of that process. Parameters on the CPU can never be part
of a CUDA graph capture, so for an optimizer holding only CPU parameters the check is moot: skip it.
"""

from __future__ import annotations

import torch

# The check's name since torch 2.8, and before.
_CHECKS = ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check")


def _no_check() -> None:
    return None


def cpu_only(optimizer: torch.optim.Optimizer) -> bool:
    return all(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"])


def without_cuda_check(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer`, whose step() no longer calls into CUDA when all its parameters are on the CPU
    (unchanged otherwise: a GPU optimizer keeps its check)."""
    if cpu_only(optimizer):
        for name in _CHECKS:
            if hasattr(optimizer, name):
                setattr(optimizer, name, _no_check)  # instance attribute: this optimizer only
    return optimizer
