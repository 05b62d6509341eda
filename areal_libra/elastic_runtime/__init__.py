"""Elastic Hybrid Pool runtime on torch.distributed: the core trainer's side (core), the cross-replica
gradient domain, snapshot publish/fetch, hybrid workers, and the controller that applies the policy."""
