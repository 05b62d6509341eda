"""`python -m areal_libra.launch ... --dry-run` (issue 26's Must-show) and libra.train_backend, without a GPU.

The dry run prints what the launch would start: the servers' command lines come from rollout/launcher.plan_servers,
the function launch_servers runs, and the trainer's from launch.trainer_command, which _run_in runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from areal_libra import launch
from areal_libra.config import compose
from areal_libra.live.live_cluster import ControlError, megatron_available, plan_source, train_layout
from areal_libra.rollout.launcher import port_range
from tests.sglang.test_command_lines import parse_with_sglang

MUST_SHOW = ["experiment=dapo_math", "cluster=gpu", "model=qwen3_8b", "libra.control.cluster=h100x8"]
NCCL = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def _dry(tmp_path: Path, *extra: str) -> dict:
    # HF_HUB_OFFLINE: the id is never fetched (the planner takes the qwen3-8b preset's shape)
    root = tmp_path / "root"
    out = launch.dry_run(compose([*MUST_SHOW, f"cluster.fileroot={root}", *extra]))
    assert not root.exists(), "a dry run wrote into the run root"
    return json.loads(json.dumps(out))  # what the CLI prints


@pytest.fixture(scope="module")
def auto(tmp_path_factory) -> dict:
    return _dry(tmp_path_factory.mktemp("auto"))


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> dict:
    return _dry(tmp_path_factory.mktemp("meg"), "libra.train_backend=megatron")


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _check_layout(d: dict) -> None:
    servers, trainer, plan = d["servers"], d["trainer"], d["plan"]
    seeds = [_flag(s["argv"], "--random-seed") for s in servers]
    assert len(set(seeds)) == len(servers)
    ports = [int(_flag(s["argv"], "--port")) for s in servers]
    dist = [int(_flag(s["argv"], "--dist-init-addr").rpartition(":")[2]) for s in servers]
    assert len(set(ports + dist)) == 2 * len(servers)
    for i, (p, q) in enumerate(zip(ports, dist)):  # AReaL's per-server port slice
        lo, hi = port_range(i, len(servers))
        assert lo <= p < hi and lo <= q < hi
    assert [s["addr"] for s in servers] == d["trainer"]["env"]["AREAL_LLM_SERVER_ADDRS"].split(",")
    for s in servers:
        assert s["argv"][1:3] == ["-m", "sglang.launch_server"]
        assert s["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(s["gpus"])
        assert len(s["gpus"]) == int(_flag(s["argv"], "--tp-size"))
    assert NCCL.items() <= trainer["env"].items()
    # every GPU of the node used once: the trainer's and the servers', disjoint, as the plan splits them
    used = trainer["gpus"] + [g for s in servers for g in s["gpus"]]
    assert sorted(used, key=int) == [str(i) for i in range(8)]
    assert plan["n_gpus"] == 8 and plan["idle_gpus"] == 0
    assert plan["train"]["gpus"] + plan["rollout"]["gpus"] == 8
    assert len(trainer["gpus"]) == plan["train"]["gpus"]
    assert sum(len(s["gpus"]) for s in servers) == plan["rollout"]["gpus"]
    assert trainer["actor_backend"] == plan["actor_backend"]
    nproc = len(trainer["gpus"])
    argv = trainer["argv"]
    assert argv[-4:] == ["-m", "areal_libra.live.train", "--run-dir", d["run_dir"]]
    if nproc > 1:  # torchrun gives every rank its RANK; the launcher does not set one
        assert argv[1:3] == ["-m", "torch.distributed.run"] and _flag(argv, "--nproc-per-node") == str(nproc)
        assert _flag(argv, "--master-port") == trainer["env"]["MASTER_PORT"] and "RANK" not in trainer["env"]
    assert any("/health" in n for n in d["not_checked"]) and any("xccl" in n for n in d["not_checked"])


def test_the_must_show_dry_run(auto):
    _check_layout(auto)
    backend = auto["plan"]["train"]["backend"]
    assert backend == ("megatron" if megatron_available() and (auto["plan"]["train"]["tp"] > 1
                                                               or auto["plan"]["train"]["pp"] > 1) else "fsdp")
    assert auto["plan"]["train"]["pp"] == 1 or backend == "megatron"  # FSDP has no pipeline
    assert any("Qwen/Qwen3-8B" in n for n in auto["not_checked"]) or Path(
        auto["servers"][0]["argv"][auto["servers"][0]["argv"].index("--model-path") + 1]).is_dir()


def test_megatron_shows_the_planners_layout(megatron):
    _check_layout(megatron)
    alloc = megatron["trainer"]["actor_backend"]
    m = re.fullmatch(r"megatron:d(\d+)t(\d+)p(\d+)", alloc)
    assert m, alloc
    d, t, p = map(int, m.groups())
    assert d * t * p == len(megatron["trainer"]["gpus"])
    assert (t, p) == (megatron["plan"]["train"]["tp"], megatron["plan"]["train"]["pp"])
    assert "MegatronEngine" in " ".join(megatron["not_checked"])
    assert megatron_available() or any("megatron-core" in n for n in megatron["not_checked"])


def test_every_dry_run_server_argv_parses_with_sglangs_server_args(auto, megatron):
    servers = [s for d in (auto, megatron) for s in d["servers"]]
    for s, ns in zip(servers, parse_with_sglang([s["argv"][3:] for s in servers]), strict=True):
        assert ns["tp_size"] == len(s["gpus"]) and ns["random_seed"] == int(_flag(s["argv"], "--random-seed"))


@pytest.mark.parametrize("args, needle", [
    (["model=qwen9"], "unknown model 'qwen9'"),
    (["libra.train_backend=deepspeed"], "train_backend must be one of auto, fsdp, megatron"),
    (["libra.train_backend=megatron", "libra.elastic.enabled=true"], "libra.elastic supports a single-rank fsdp trainer only"),
    (["cluster=cpu", "libra.train_backend=megatron"], "train_backend=megatron needs libra.device=cuda"),
    (["libra.control.cluster=cpu"], "needs libra.control.cluster=<preset>"),
    (["actor.path=nobody/nomodel"], "no config.json here and no model preset"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = launch.main([*MUST_SHOW, f"cluster.fileroot={tmp_path}", *args, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_cli_prints_the_json(capsys, tmp_path):
    rc = launch.main(["cluster=gpu", "libra.control.cluster=h100x8", f"cluster.fileroot={tmp_path}", "--dry-run"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["plan"]["n_gpus"] == 8 and len(d["servers"]) >= 1
    assert NCCL.items() <= d["trainer"]["env"].items()


def test_a_given_rollout_alloc_keeps_its_servers_and_the_trainer_takes_the_rest(tmp_path):
    d = _dry(tmp_path, "rollout_alloc=sglang:d2t1+d1t2")
    assert [len(s["gpus"]) for s in d["servers"]] == [1, 1, 2]
    assert len(d["trainer"]["gpus"]) == 4 == d["plan"]["train"]["gpus"]
    with pytest.raises(launch.LaunchError, match="leaves none to the trainer"):
        _dry(tmp_path, "rollout_alloc=sglang:d4t2")


def test_the_trainers_planner_keeps_the_layout_it_runs(tmp_path):
    """The trainer's view (train_backend None): exactly actor.backend's GPUs, so a live plan's rollout side always
    fits the devices the trainer leaves; the CPU trainer stays one FSDP process without TP or PP."""
    from areal_libra.config import libra_config
    from areal_libra.cost.presets import load_model

    c = compose([*MUST_SHOW, "actor.backend=megatron:d1t1p3"])
    src = plan_source(libra_config(c.libra), c.areal, "", model=load_model("qwen3-8b"))
    plan = src.solve([(256, 256 + 4096)] * 64)
    assert plan.train_backend == "megatron" and plan.train_gpus == 3 and plan.rollout_gpus == 5
    c.areal.actor.backend = "fsdp:d2t2"
    plan = plan_source(libra_config(c.libra), c.areal, "", model=load_model("qwen3-8b")).solve([(256, 4352)] * 64)
    assert (plan.train_backend, plan.train_gpus, plan.train.tp, plan.train.pp) == ("fsdp", 4, 2, 1)


def test_train_layout_reads_areal_allocations():
    assert train_layout("megatron:d2t2p1")[0] == "megatron" and train_layout("megatron:d2t2p1")[1].gpus == 4
    assert train_layout("fsdp:d4")[1].gpus == 4 and train_layout("fsdp:d2t2p1")[1].tp == 2
    for bad in ("sglang:d2t1", "fsdp:d2p2", "nonsense"):
        with pytest.raises(ControlError) as e:
            train_layout(bad)
        assert "\n" not in str(e.value)


def test_trainer_command_and_env_by_rank_count(tmp_path):
    c = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}"])
    one = launch.trainer_env_overlay(c, ["a:1"], ("0",), ("1",), nproc=1)
    four = launch.trainer_env_overlay(c, ["a:1"], ("0", "1", "2", "3"), ("4",), nproc=4)
    assert one["RANK"] == "0" and one["WORLD_SIZE"] == "1" and "RANK" not in four and "WORLD_SIZE" not in four
    assert launch.trainer_command(tmp_path, 1, "1")[1:3] == ["-m", "areal_libra.live.train"]
    cmd = launch.trainer_command(tmp_path, 4, one["MASTER_PORT"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and _flag(cmd, "--nproc-per-node") == "4"
    # the embedded CPU cluster: one trainer process whatever actor.backend says
    assert launch.trainer_gpus(compose([f"cluster.fileroot={tmp_path}", "actor.backend=fsdp:d4"])) == 1
    assert launch.trainer_gpus(compose(["cluster=gpu", "actor.backend=megatron:d1t2p2"])) == 4


def test_megatron_without_megatron_core_is_refused_before_anything_starts(tmp_path):
    if megatron_available():
        pytest.skip("megatron-core is installed here")
    c = compose(["cluster=gpu", "libra.train_backend=megatron", "actor.backend=megatron:d1t1p3"])
    with pytest.raises(launch.LaunchError) as e:
        launch.check_train_backend(c)
    assert "make setup-gpu" in str(e.value) and "\n" not in str(e.value)
    static = compose(["cluster=gpu", "libra.mode=static", "libra.train_backend=megatron"])  # actor.backend fsdp:d1
    with pytest.raises(launch.LaunchError, match="libra.mode=static runs actor.backend as given"):
        launch.check_train_backend(static)


def test_a_cpu_dry_run_shows_the_embedded_cluster(tmp_path):
    d = launch.dry_run(compose([f"cluster.fileroot={tmp_path / 'root'}"]))
    assert not (tmp_path / "root").exists()
    assert d["servers"] and all(s["argv"][2] == "areal_libra.server.embedded_server" for s in d["servers"])
    assert "NCCL_CUMEM_ENABLE" not in d["trainer"]["env"] and d["trainer"]["env"]["RANK"] == "0"
    assert d["trainer"]["argv"][1:3] == ["-m", "areal_libra.live.train"]


def test_the_elastic_pool_gets_its_single_rank_fsdp_core(tmp_path):
    from tests.cost.test_detect_cluster import QWEN3_1_7B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_7B))  # a local copy's config (no weights needed)
    d = launch.dry_run(compose(["cluster=gpu", "model=qwen3_1_7b", "libra.control.cluster=h100x8",
                                f"actor.path={tmp_path}",
                                "libra.elastic.enabled=true", "libra.scheduler.policy=cmlfq",
                                f"cluster.fileroot={tmp_path}"]))
    assert d["trainer"]["actor_backend"] == "fsdp:d1t1p1" and d["plan"]["train"]["gpus"] == 1
    assert d["trainer"]["argv"][1:3] == ["-m", "areal_libra.live.train"]
    assert sum(len(s["gpus"]) for s in d["servers"]) == 7


def test_the_real_launch_plans_places_and_stops_before_starting_without_sglang(tmp_path, monkeypatch, capsys):
    """launch.run on cluster=gpu goes through the same plan and placement as the dry run (8 visible devices named
    here) and stops, one line, where the CPU machine lacks SGLang's GPU install or megatron-core."""
    import importlib.util

    from tests.cost.test_detect_cluster import QWEN3_1_7B

    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a GPU SGLang install is present")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN3_1_7B))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(8))))
    args = ["cluster=gpu", "model=qwen3_1_7b", "libra.control.cluster=h100x8", f"actor.path={tmp_path / 'm'}",
            f"cluster.fileroot={tmp_path / 'root'}"]
    assert launch.main(args) == 2
    assert "make setup-gpu" in capsys.readouterr().err
    if not megatron_available():
        assert launch.main([*args, "libra.train_backend=megatron"]) == 2
        assert "needs megatron-core" in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # fewer devices than the plan
    assert launch.main(args) == 2
    assert "needs 8 GPUs" in capsys.readouterr().err
    assert not (tmp_path / "root").exists()
