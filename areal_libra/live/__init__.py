"""The training side of a run: the trainer process (train), the live cluster adapter of the LibraController
(live_cluster), recovery (recover) and the Elastic Hybrid Pool's hooks into AReaL (elastic_*)."""
