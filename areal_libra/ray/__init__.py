"""Libra on Ray: a local multi-node Ray cluster (cluster=ray_local), the Ray rollout-server backend, the
trainer's ranks as Ray actors and the run's placement.json (cluster=ray / ray_local)."""
