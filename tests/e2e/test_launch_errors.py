"""Bad input to the launcher: one clear line naming the problem, non-zero exit, no traceback."""

import subprocess
import sys

import pytest

from areal_libra import launch
from areal_libra.config import ConfigError, compose

CASES = [
    (["experiment=no_such_exp"], "unknown experiment 'no_such_exp'"),
    (["no_such_key=1"], "unknown config key 'no_such_key'"),
    (["train_dataset.path=/nonexistent/dapo.parquet"], "train_dataset.path=/nonexistent/dapo.parquet: no such file"),
    (["actor.path={tmp}"], "is not a Hugging Face model"),
    (["libra.max_turns=abc"], "bad override 'libra.max_turns=abc'"),
    (["libra.scheduler.polcy=cmlfq"], "unknown config key 'scheduler.polcy'"),
    # the former dict sections are dataclasses: a typo is one line at launch, before any server starts
    (["libra.scheduler.cmlfq.min_sample=3"], "unknown config key 'scheduler.cmlfq.min_sample'"),
    (["libra.elastic.runtime.heartbeat_timout_s=3"], "unknown config key 'elastic.runtime.heartbeat_timout_s'"),
    (["libra.control.elastic_policy.join_ration=1.3"], "unknown config key 'control.elastic_policy.join_ration'"),
    (["libra.control.replan_policy.evry_k=5"], "unknown config key 'control.replan_policy.evry_k'"),
    (["libra.elastic.policy.join_ratio=1.3"], "unknown config key 'elastic.policy.join_ratio'"),  # moved to control
    (["libra.control.replan_policy.every_k=0"], "every_k must be >= 1"),
]


def _check(rc: int, stderr: str, expected: str, root) -> None:
    assert rc == 2
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in stderr
    assert any(expected in ln for ln in lines), stderr
    assert lines[-1].startswith("areal_libra: error:")
    assert not list(root.glob("logs/**/servers.json"))  # nothing was started


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_bad_input(args: list[str], expected: str, tmp_path, capsys) -> None:
    """Each case through launch.main in this process (a subprocess each cost ~11 s of AReaL's imports)."""
    args = [a.format(tmp=tmp_path) for a in args]
    rc = launch.main([*args, f"cluster.fileroot={tmp_path}"])
    _check(rc, capsys.readouterr().err, expected.format(tmp=tmp_path), tmp_path)


@pytest.mark.parametrize(("args", "expected"), [CASES[1], CASES[-1]])
def test_cli_bad_input(args: list[str], expected: str, tmp_path) -> None:
    """The command line itself (`python -m areal_libra.launch`): the same one line and exit status 2."""
    r = subprocess.run([sys.executable, "-m", "areal_libra.launch", *args, f"cluster.fileroot={tmp_path}"],
                       capture_output=True, text=True, timeout=180)
    _check(r.returncode, r.stderr, expected, tmp_path)


def test_overrides_keep_areal_names_and_fall_through_to_libra() -> None:
    c = compose(["total_train_steps=2", "cluster.fileroot=/x", "scheduler.policy=cmlfq", "trial_name=t1"])
    assert c.areal.total_train_steps == 2 and c.areal.cluster.fileroot == "/x"
    assert c.libra.scheduler.policy == "cmlfq"
    assert c.areal.rollout.trial_name == "t1" and str(c.log_dir).endswith("/dapo-math/t1")



@pytest.mark.parametrize("experiment", ["dapo_math", "search_r1", "code_sandbox"])
def test_seed_override_reaches_libra_interpolations(experiment: str) -> None:
    """`seed=2` must change the generated problem set too (libra.dataset.seed: ${seed}), not only AReaL's seed."""
    c = compose([f"experiment={experiment}", "seed=2"])
    assert c.areal.seed == 2 and c.libra.dataset.seed == 2
    assert compose([f"experiment={experiment}"]).libra.dataset.seed == 1


@pytest.mark.parametrize("bad", ["actor.optimizer.lr=abc", "libra.nope=1", "cluster=nope", "novalue"])
def test_compose_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        compose([bad])


def test_libra_tree_is_typed() -> None:
    """`libra:` is a LibraConfig: defaults fill in, values are typed, a typo in a nested key is refused."""
    from areal_libra.config import LibraConfig, libra_config

    c = compose(["cluster=cpu_hetero", "libra.elastic.hybrids=2"])
    typed = libra_config(c.libra)
    assert isinstance(typed, LibraConfig) and typed.elastic.hybrids == 2
    assert [g.threads for g in typed.rollout_groups] == [None, None] and typed.scheduler.policy == "cmlfq"
    with pytest.raises(ConfigError, match="rollout_groups"):
        compose(["libra.rollout_groups=[{name: a, tp: two}]"])
    with pytest.raises(ConfigError, match="bogus"):
        libra_config({"elastic": {"bogus": 1}})


def test_trainer_loads_the_typed_config_the_launch_saved(tmp_path) -> None:
    """What the launch validated and saved is what the trainer gets back (config.load_run_config), typed down to
    the former dict sections, with the overrides applied."""
    from areal_libra.config import ControlSettings, libra_config, load_run_config, save
    from areal_libra.elastic_runtime.settings import RuntimeConfig

    c = compose(["cluster=emulated", "libra.elastic.enabled=true", "libra.scheduler.cmlfq.min_samples=3",
                 "libra.elastic.runtime.heartbeat_timeout_s=7", "libra.control.replan_policy.every_k=4",
                 f"cluster.fileroot={tmp_path}"])
    save(c, tmp_path / "run")
    typed = load_run_config(tmp_path / "run")
    assert typed == libra_config(c.libra) and isinstance(typed.control, ControlSettings)
    assert typed.control.replan_policy.every_k == 4 and typed.control.settle_steps == 10
    assert typed.scheduler.cmlfq.min_samples == 3 and typed.scheduler.cmlfq.auto_background
    assert typed.elastic.runtime == RuntimeConfig(heartbeat_timeout_s=7.0)


def test_a_mistyped_choice_is_reported_before_areals_schema_is_imported() -> None:
    """experiment/cluster/model choices are checked before AReaL's config schema (torch, transformers: ~10 s)
    is imported, so the commonest typo is answered at once."""
    code = ("import sys\n"
            "from areal_libra.config import ConfigError, compose\n"
            "try:\n"
            "    compose(['experiment=no_such_exp'])\n"
            "except ConfigError as e:\n"
            "    print('error:', e)\n"
            "print('areal schema imported:', 'areal.api.cli_args' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "error: unknown experiment 'no_such_exp'" in r.stdout, r.stdout + r.stderr
    assert "areal schema imported: False" in r.stdout, r.stdout


# Overrides the early check (AReaL's key shape cached) and the full one must judge alike: AReaL keys at several
# depths, libra keys with and without `libra.`, typos in both, a key under one of AReaL's leaves.
EARLY = ["no_such_key=1", "actor.no_such=3", "actor.optimizer.lr=1e-5", "actor.optimizer.lr.deeper=1",
         "stats_logger.wandb.mode=offline", "control.replan_policy.every_k=5", "control.every_k=5", "libra.nope=1"]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache folder holding AReaL's key shape, written by one compose."""
    root = tmp_path_factory.mktemp("warm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AREAL_LIBRA_CACHE", str(root))
        compose([])
    assert len(list(root.glob("config/areal-grpo-keys-*.json"))) == 1
    return root


@pytest.mark.parametrize("override", EARLY)
def test_the_early_key_check_agrees_with_the_full_one(override: str, warm_cache, tmp_path, monkeypatch) -> None:
    import areal_libra.config as config

    def outcome() -> str:
        try:
            compose([override])
            return "ok"
        except ConfigError as e:
            return str(e)

    monkeypatch.setenv("AREAL_LIBRA_CACHE", str(tmp_path))
    cold = outcome()  # no shape cached: the full check decides
    monkeypatch.setenv("AREAL_LIBRA_CACHE", str(warm_cache))
    reached = []
    real = config._cache_key_shape
    monkeypatch.setattr(config, "_cache_key_shape", lambda schema: (reached.append(1), real(schema)))
    assert outcome() == cold
    if "neither an AReaL GRPOConfig key nor a libra key" in cold:
        assert not reached  # refused before AReaL's schema was built


def test_a_mistyped_key_is_reported_before_areals_schema_is_imported(warm_cache) -> None:
    """Once a run has cached the shape of this AReaL's config, a key that is neither AReaL's nor libra's is answered
    without importing AReaL's schema (torch, transformers: ~10 s)."""
    import os

    code = ("import sys\n"
            "from areal_libra.config import ConfigError, compose\n"
            "try:\n"
            "    compose(['no_such_key=1'])\n"
            "except ConfigError as e:\n"
            "    print('error:', e)\n"
            "print('areal schema imported:', 'areal.api.cli_args' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "AREAL_LIBRA_CACHE": str(warm_cache)})
    assert "error: unknown config key 'no_such_key'" in r.stdout, r.stdout + r.stderr
    assert "areal schema imported: False" in r.stdout, r.stdout


def test_key_shape_opens_where_omegaconf_decides_later() -> None:
    from dataclasses import dataclass, field

    from omegaconf import OmegaConf

    from areal_libra.config import OPEN, key_shape, shape_rejects

    @dataclass
    class Inner:
        a: int = 1

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)
        maybe: Inner | None = None
        extra: dict = field(default_factory=dict)
        x: float = 0.0

    shape = key_shape(OmegaConf.structured(Outer))
    assert shape == {"inner": {"a": OPEN}, "maybe": OPEN, "extra": OPEN, "x": OPEN}
    assert shape_rejects(shape, "nope") and shape_rejects(shape, "inner.b")
    assert not any(shape_rejects(shape, k) for k in ("inner.a", "maybe.a", "maybe.b", "extra.k.j", "x"))
