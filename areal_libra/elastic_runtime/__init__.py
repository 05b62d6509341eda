"""Elastic Hybrid Pool runtime on torch.distributed: the core trainer's side (core), the cross-replica
gradient domain, snapshot publish/fetch, hybrid workers. Decisions are the LibraController's
(areal_libra.control), not the runtime's."""
