"""Integration with AReaL: the request router patched into AReaL's engine (router), server groups and
their launch (groups, launcher), the live prefix tree, health checks, the elastic hooks and the trainer
entry point (train)."""
