"""The elastic runtime's settings (`libra.elastic.runtime`), apart from the runtime itself so that the config
schema (areal_libra.config) does not import torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    namespace: str = "elastic"
    backend: str = "gloo"  # "nccl" on GPU clusters
    domain_timeout_s: float = 10.0  # a collective with a dead/hung peer fails after this
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 2.0  # a hybrid rank silent for this long is declared dead
    plan_timeout_s: float = 600.0  # how long followers wait for the leader's next plan
    chunk_elems: int = 1 << 22
    snapshot_keep: int = 2
    max_attempts: int = 4  # per step; after that every hybrid is dropped and the core goes on alone
    fetch_retries: int = 5
    fetch_delay_s: float = 0.0  # fault-injection and benchmarking: extra fetch time
