"""Elastic Hybrid Pool, pure core: the pool/worker state machine (state.py) and the join/release policy
(policy.py). No torch: the torch.distributed runtime is areal_libra.elastic_runtime."""
