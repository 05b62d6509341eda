"""Fixtures shared across the suite: the tiny random Qwen2 checkpoints, real embedded rollout servers, and
runs of the elastic test bed (tests/rigs/elastic_bed.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

try:  # the HTTP fuzzing's long run: pytest tests/server/test_server_fuzz.py --hypothesis-profile=fuzz-long
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("fuzz-long", max_examples=2000)
except ImportError:  # hypothesis is a dev requirement
    pass


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 checkpoint in Hugging Face format (config, weights, tokenizer), built offline."""
    from areal_libra.models.random_tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="session")
def tiny_model_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny checkpoints with different weights (seed 0 and 1), for weight-update tests."""
    from areal_libra.models.random_tiny import TinyModelSpec, build_tiny_model

    root = tmp_path_factory.mktemp("tiny_pair")
    return (build_tiny_model(str(root / "a"), TinyModelSpec(seed=0)),
            build_tiny_model(str(root / "b"), TinyModelSpec(seed=1)))


@pytest.fixture(scope="module")
def embedded_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable]:
    """launch(model_dir, specs, timeout=120) -> handles of real embedded servers (subprocesses on loopback);
    all are shut down when the module's tests are done."""
    from areal_libra.rollout.launcher import launch_servers, shutdown

    launched: list = []
    root = tmp_path_factory.mktemp("servers")

    def launch(model_dir: str, specs: list, timeout: float = 120.0) -> list:
        handles = launch_servers(model_dir, specs, str(root / f"logs{len(launched)}"), backend="embedded",
                                 timeout=timeout)
        launched.extend(handles)
        return handles

    yield launch
    shutdown(launched)


@pytest.fixture()
def elastic_bed(tmp_path):
    """bed(TestbedConfig, name) -> the results of one elastic test-bed run (real processes over gloo) in its
    own directory under the test's tmp_path."""
    from tests.rigs.elastic_bed import run

    def bed(cfg, name: str = "bed") -> dict:
        return run(cfg, str(tmp_path / name))

    return bed
