"""cluster=emulated: embedded servers and the trainer paced to the simulator's hardware truth (qwen3-14b on
h200), the accelerator budget, bad emulation input; and "TP t = t threads" on CPU."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_libra.cost.presets import load_hardware, load_model
from areal_libra.rollout.emulation import (
    ClusterEmulation,
    EmulationError,
    ServerEmulation,
    configure,
    pace_train_step,
    pacing_report,
)
from areal_libra.rollout.groups import RolloutGroup, group_from_mapping
from areal_libra.rollout.launcher import ServerSpec, build_command
from areal_libra.server.inprocess import InProcessServer, http
from areal_libra.sim.hardware import truth_from_specs

# Targets of 90-150 ms per iteration: well above the tiny model's own compute per iteration even on a
# loaded 2-core machine (pacing can only slow an iteration down).
SCALE = 10.0


def _truth():
    # built here from the presets, independently of the emulation module's own lookup
    return truth_from_specs(load_hardware("h200"), load_model("qwen3-14b"))


@pytest.fixture(scope="module")
def paced_servers(tiny_model_dir, embedded_servers):
    """Real paced servers (subprocesses, as in a run: in-process, the test's HTTP threads share the engine's
    GIL and slow its compute several-fold), TP1 and TP2, paced to qwen3-14b on h200 at SCALE."""
    emu = ClusterEmulation(time_scale=SCALE)
    specs = [emu.emulate_spec(ServerSpec(tp=tp, max_running=64)) for tp in (1, 2)]
    return dict(zip((1, 2), embedded_servers(tiny_model_dir, specs)))


def _burst(addr: str, batch: int, new_tokens: int) -> None:
    body = {"input_ids": [5, 6, 7, 8, 9, 10], "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    with ThreadPoolExecutor(batch) as ex:
        outs = list(ex.map(lambda _: http(addr, "/generate", body), range(batch)))
    assert all(st == 200 and o["meta_info"]["completion_tokens"] == new_tokens for st, o in outs)


def _decode_iterations(server, batch: int) -> list[tuple[float, float, float]]:
    """(measured, truth, own compute) seconds of each recent decode iteration at this batch size, from the
    server's own timing; truth is computed here, independently of the server."""
    info = http(server.addr, "/get_server_info")[1]
    truth, tp = _truth(), server.spec.tp
    assert info["emulation"]["tp"] == tp and info["tp_size"] == tp and info["threads"] == 1
    return [
        (measured, SCALE * truth.decode_iteration_s(tp, b, tokens), compute)
        for kind, b, tokens, measured, _target, compute in info["emulation"]["recent"]
        if kind == "decode" and b == batch
    ]


def _check_paced(its: list[tuple[float, float, float]]) -> float:
    """Never faster than the truth; where the tiny model's own compute fit under the target (the only case
    pacing can control) the iteration takes the truth's time within 20%. Returns the median measured time."""
    assert len(its) >= 6
    assert all(m >= 0.97 * t for m, t, _ in its), its
    held = [m / t for m, t, c in its if c < t]
    assert len(held) >= len(its) // 2, f"most iterations overran on this machine: {its}"
    assert 0.8 <= statistics.median(held) <= 1.2, held
    return statistics.median(m for m, _, _ in its)


@pytest.mark.parametrize("batch", [1, 8])
def test_tp1_decode_iteration_matches_truth(paced_servers, batch):
    server = paced_servers[1]
    _burst(server.addr, batch, 12)
    _check_paced(_decode_iterations(server, batch))
    st = http(server.addr, "/get_server_info")[1]["engine_stats"]
    assert st["paced_decode_iterations"] > 0 and st["pace_sleep_seconds"] > 0


def test_tp2_faster_than_tp1_as_truth_says(paced_servers):
    per_step = {}
    for tp, server in paced_servers.items():
        _burst(server.addr, 1, 16)
        per_step[tp] = _check_paced(_decode_iterations(server, 1))
    truth = _truth()
    expected = truth.decode_iteration_s(1, 1, 30) / truth.decode_iteration_s(2, 1, 30)
    assert expected > 1.2  # truth: TP2 decodes a lone sequence markedly faster
    assert per_step[2] < per_step[1]
    assert abs(per_step[1] / per_step[2] - expected) / expected < 0.2, (per_step, expected)
    addrs = [s.addr for s in paced_servers.values()]
    rep = pacing_report(addrs + ["127.0.0.1:1"], timeout=1.0)
    stats = [http(a, "/get_server_info")[1]["engine_stats"] for a in addrs]
    assert rep["paced_iterations"] == sum(st["paced_iterations"] for st in stats) > 0
    assert rep["decode_iterations"] == sum(st["paced_decode_iterations"] for st in stats) > 0
    assert rep["unreachable"] == 1 and 0.0 <= rep["overrun_fraction"] <= 1.0


def test_unpaced_server_reports_no_emulation(tiny_model_dir):
    s = InProcessServer(tiny_model_dir)
    try:
        _burst(s.addr, 2, 4)
        info = http(s.addr, "/get_server_info")[1]
        assert "emulation" not in info and info["engine_stats"]["paced_iterations"] == 0
        assert info["threads"] == 1
    finally:
        s.close()


def _settled_info(addr: str, timeout_s: float = 10.0) -> dict:
    """/get_server_info once the engine has stopped pacing (the burst's last iteration may still be sleeping)."""
    deadline = time.monotonic() + timeout_s
    info = http(addr, "/get_server_info")[1]
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = http(addr, "/get_server_info")[1]
        if again["engine_stats"]["paced_iterations"] == info["engine_stats"]["paced_iterations"]:
            return again
        info = again
    return info


def test_an_injected_pacing_paces_an_in_process_server(tiny_model_dir):
    """A hybrid replica's in-process server is given its pacing object (the server has no emulation flags)."""
    from areal_libra.rollout.emulation import ServerPacing

    pacing = ServerPacing(tp=1, time_scale=SCALE, growth=1.0, horizon=4)
    s = InProcessServer(tiny_model_dir, pacing)
    try:
        _burst(s.addr, 2, 4)
        info = _settled_info(s.addr)
        assert info["emulation"]["model"] == "qwen3-14b" and info["emulation"]["tp"] == 1
        decodes = [x for x in info["emulation"]["recent"] if x[0] == "decode"]
        assert info["engine_stats"]["paced_decode_iterations"] == len(decodes) > 0
        # each iteration's target is the injected pacing's (weight version "default": lengths not grown yet)
        truth = _truth()
        for _kind, batch, tokens, _measured, target, _compute in decodes:
            assert target == pytest.approx(SCALE * truth.decode_iteration_s(1, batch, tokens))
    finally:
        s.close()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--emulate-model", "nope-7b", "--emulate-gpu", "h200"], "nope-7b"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "tpu9"], "tpu9"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "h200", "--emulate-time-scale", "0"], "time scale"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "h200", "--emulate-time-scale", "nan"], "time scale"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "h200", "--emulate-tp", "0"], "TP"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "h200", "--emulate-tp", "16"], "node"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "cpu"], "KV-cache"),
        (["--emulate-model", "qwen3-14b"], "together"),
        (["--emulate-tp", "2"], "needs --emulate-model"),
        (["--emulate-model", "qwen3-14b", "--emulate-gpu", "h200", "--emulate-growth", "-1"], "growth"),
    ],
)
def test_bad_emulation_args_are_one_line_exit_2(args, needle, capsys, tmp_path):
    """The emulated server's entry point (rollout.emulation), the embedded server's own flags after them."""
    from areal_libra.rollout.emulation import parse_server_args

    (tmp_path / "config.json").write_text("{}")  # the server's CLI checks only that the model dir has one
    with pytest.raises(SystemExit) as e:
        parse_server_args(["--model-path", str(tmp_path)] + args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_accelerator_budget():
    emu = ClusterEmulation(accelerators=16)
    groups = [RolloutGroup("short", tp=1, count=2), RolloutGroup("long", tp=2, count=1)]
    assert emu.check_layout(groups) == (4, 12)
    assert emu.check_layout(groups, trainer=8) == (4, 8)
    with pytest.raises(EmulationError, match="none is left for the trainer"):
        emu.check_layout([RolloutGroup("g", tp=4, count=4)])
    with pytest.raises(EmulationError, match="= 17, but the emulated cluster has 16"):
        emu.check_layout(groups, trainer=13)
    with pytest.raises(EmulationError, match="rollout group g: .*node"):
        emu.check_layout([RolloutGroup("g", tp=16, count=1)], trainer=1)
    with pytest.raises(EmulationError, match="accelerators"):
        ClusterEmulation(accelerators=0)
    with pytest.raises(EmulationError, match="unknown hardware"):
        ClusterEmulation(gpu="b300")
    spec = emu.emulate_spec(ServerSpec(tp=2, threads=2, max_running=8))
    assert spec.n_threads == 1 and "--emulate-tp" in spec.extra_args and "2" in spec.extra_args
    cmd = build_command("embedded", "/m", spec, "127.0.0.1", 1)
    assert cmd[1:3] == ["-m", "areal_libra.rollout.emulation"]  # started paced, by the emulation's entry point
    assert build_command("embedded", "/m", ServerSpec(), "127.0.0.1", 1)[2] == "areal_libra.server.embedded_server"


def test_cluster_emulated_composes_and_a_layout_that_does_not_fit_is_refused(capsys):
    from areal_libra import launch
    from areal_libra.config import compose

    c = compose(["cluster=emulated"])
    emu = launch.emulation(c)
    assert emu is not None and emu.accelerators == 16 and emu.model == "qwen3-14b" and emu.gpu == "h200"
    specs = launch.server_specs(c)
    assert [s.tp for s in specs] == [1, 1, 2] and all("--emulate-model" in s.extra_args for s in specs)
    c.libra.emulated.enabled = False
    assert launch.emulation(c) is None  # any other cluster: not emulated
    rc = launch.main(["cluster=emulated", "libra.emulated.accelerators=4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "none is left for the trainer" in err, err


def test_pace_train_step():
    configure(None)
    assert pace_train_step(1000, 4) is None  # not emulated: a no-op
    emu = ClusterEmulation(time_scale=0.05)
    configure(emu)
    try:
        lens = [160] * 128
        t0 = time.perf_counter()
        rec = pace_train_step(lens, 8, started_at=t0)
        elapsed = time.perf_counter() - t0
        truth = _truth()
        # the target is the truth's time for the best of the layouts a job could use, scaled
        best = min(truth.train_step_s(lens, tp, 1, 8 // tp) for tp in (1, 2, 4, 8))
        assert rec is not None and rec["emul/train_target_s"] <= 0.05 * best + 1e-9
        assert rec["emul/train_target_s"] >= 0.05 * truth.c.optimizer_s  # never below the optimizer step
        assert abs(elapsed - rec["emul/train_target_s"]) / rec["emul/train_target_s"] < 0.2
        # more accelerators train the same batch faster; more tokens take longer
        assert emu.train_target_s(lens, 8) < emu.train_target_s(lens, 2)
        assert emu.train_target_s([320] * 128, 8) > emu.train_target_s(lens, 8)
        with pytest.raises(EmulationError, match="n_accel"):
            pace_train_step(lens, 0)
    finally:
        configure(None)


def test_server_emulation_targets_follow_truth():
    e1, e2 = ServerEmulation(tp=1, time_scale=2.0), ServerEmulation(tp=2, time_scale=2.0)
    truth = _truth()
    assert e1.decode_s(32, 3200) == pytest.approx(2.0 * truth.decode_iteration_s(1, 32, 3200))
    assert e2.prefill_s([(1000, 0), (500, 100)]) == pytest.approx(
        2.0 * (truth.prefill_s(2, 1000, 0) + truth.prefill_s(2, 500, 100))
    )
    assert e2.decode_s(32, 3200) < e1.decode_s(32, 3200)


def test_threads_default_to_tp_with_explicit_override(tiny_model_dir):
    """On CPU a TP t embedded server runs t compute threads unless `threads` is given."""
    assert group_from_mapping({"tp": 2}, 0).threads == 2
    assert group_from_mapping({"tp": 2, "threads": 1}, 0).threads == 1
    assert RolloutGroup("g", tp=4).threads == 4
    assert ServerSpec(tp=2).n_threads == 2 and ServerSpec(tp=2, threads=1).n_threads == 1
    cmd = build_command("embedded", "/m", ServerSpec(tp=2), "127.0.0.1", 1)
    assert cmd[cmd.index("--threads") + 1] == "2"
    from areal_libra.server.embedded_server import parse_args

    assert parse_args(["--model-path", tiny_model_dir, "--tp-size", "2"]).threads == 2
    assert parse_args(["--model-path", tiny_model_dir, "--tp-size", "2", "--threads", "1"]).threads == 1


def test_emulated_lengths_grow_with_the_weight_version():
    """length_growth: each real token stands for m(version) emulated ones, m from 1 to 1 + growth over the
    horizon; a server's pacing charges m decode iterations over m times the KV, and the flags carry it."""
    from areal_libra.rollout.emulation import ClusterEmulation, GrowingPacer, length_multiplier

    assert length_multiplier(0, 1.0, 40) == 1.0 and length_multiplier("20", 1.0, 40) == 1.5
    assert length_multiplier(400, 1.0, 40) == 2.0 and length_multiplier("default", 1.0, 40) == 1.0
    emu = ClusterEmulation(length_growth=1.0, growth_horizon=40)
    base = emu.server(1)
    version = {"v": "0"}
    pacer = GrowingPacer(base, 1.0, 40, lambda: version["v"])
    assert pacer.decode_s(16, 16 * 1024) == pytest.approx(base.decode_s(16, 16 * 1024))
    version["v"] = "40"
    assert pacer.decode_s(16, 16 * 1024) == pytest.approx(2 * base.decode_s(16, 32 * 1024))
    # A request's prompt does not grow; a later turn's prefill (tool output, prior tokens cached) does.
    assert pacer.prefill_s([(100, 0)]) == pytest.approx(base.prefill_s([(100, 0)]))
    assert pacer.prefill_s([(10, 100)]) == pytest.approx(base.prefill_s([(20, 200)]))
    assert "--emulate-growth" in emu.pacing(1).cli_args() and "--emulate-growth" not in ClusterEmulation().pacing(1).cli_args()
    # the pacing a grown server is given: the same GrowingPacer, following the server's weight version
    grown = emu.pacing(1).pacer(lambda: version["v"])
    assert isinstance(grown, GrowingPacer) and grown.decode_s(16, 1024) == pytest.approx(pacer.decode_s(16, 1024))
    with pytest.raises(ValueError, match="length_growth"):
        ClusterEmulation(length_growth=-1.0)


def test_hybrid_pool_accelerators_are_outside_the_layout():
    from areal_libra.config import compose

    emu = ClusterEmulation(accelerators=8, hybrid_accelerators=1)
    groups = [RolloutGroup("short", tp=1, count=3)]
    assert emu.check_layout(groups) == (3, 4)  # 8 - 1 hybrid - 3 rollout
    with pytest.raises(EmulationError, match="= 9, but the emulated cluster has 8"):
        emu.check_layout(groups, trainer=5)
    with pytest.raises(EmulationError, match="hybrid accelerators"):
        ClusterEmulation(hybrid_accelerators=-1)
    pacing = emu.hybrid_pacing()
    assert pacing.tp == 1 and pacing.model == "qwen3-14b"
    from areal_libra.rollout.emulation import ServerPacing

    assert ServerPacing(**pacing.as_dict()) == pacing  # as the worker gets it (--pacing JSON)
    assert pacing.pacer(lambda: "0") == emu.server(1)  # the hybrid's server is paced as a TP1 one
    c = compose(["cluster=emulated", "libra.elastic.enabled=true", "libra.elastic.hybrids=2"])
    assert ClusterEmulation.from_libra(c.libra).hybrid_accelerators == 2
    c = compose(["cluster=emulated"])
    assert ClusterEmulation.from_libra(c.libra).hybrid_accelerators == 0


def test_trainer_pacing_grows_what_follows_the_prompt():
    import torch

    from areal_libra.rollout.emulation import _batch_lengths

    attn = torch.tensor([[1] * 10 + [0] * 2, [1] * 12])
    loss = torch.tensor([[0] * 4 + [1] * 6 + [0] * 2, [0] * 12])  # row 2: nothing generated
    assert _batch_lengths({"attention_mask": attn, "loss_mask": loss}, 3.0) == [4 + 6 * 3, 12]
    assert _batch_lengths({"attention_mask": attn}, 2.0) == [20, 24]  # no loss_mask: all of it
    assert _batch_lengths([{"attention_mask": attn, "loss_mask": loss}], 1.0) == [10, 12]
