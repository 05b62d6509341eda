"""Imported by the test bed's fork server: build and step a replica once, so that the optimizer's lazy
imports (torch._dynamo, ~3 s of CPU) happen there once instead of in every child."""

from tests.rigs.elastic_bed import TestbedConfig, build_replica

build_replica(TestbedConfig(), "core", 0, None).apply_update()
