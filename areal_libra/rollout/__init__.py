"""The serving side of a run: the request router patched into AReaL (router), server groups and their
launch (groups, launcher, placement), the fleet that owns rollout membership (fleet, revive, backend, xccl: the weight-update group over a
changing server set), health checks,
the live prefix tree and the emulated accelerators."""
