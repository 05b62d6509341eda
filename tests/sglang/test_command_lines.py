"""The GPU path checked against the SGLang version requirements/gpu.txt pins (0.5.10.post1), installed without
its dependencies (`make setup-sglang`):

- every HTTP path this project calls on a server exists in that version's HTTP server module (its route
  decorators, read with ast) and is not one of its deprecated stubs that always answer 404;
- every command line launcher.build_command produces for the GPU configs (TP 1/2/4/8, with the seed, port
  and dist-init flags) parses with SGLang's own ServerArgs.add_cli_args + parse_args. That needs
  sglang.srt.server_args to import: on a CPU-only machine it does with the packages of
  requirements/sglang-cpu.txt and a torchvision stand-in in the parsing process only
  (areal_libra/rollout/sglang_args.py says why); where it still does not, the test skips, naming the import error.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from areal_libra import launch
from areal_libra.config import compose
from areal_libra.rollout import launcher
from areal_libra.rollout.launcher import ServerSpec, port_range, ports_in_range
from areal_libra.rollout.sglang_args import SGLangArgsError, SGLangUnavailable, parse_command_lines

PINNED = "0.5.10.post1"
ROOT = Path(__file__).resolve().parents[2]
# Where the project talks to SGLang servers itself (AReaL's own calls are AReaL's, tested against the same pin).
CALLERS = ("areal_libra/rollout", "areal_libra/live", "areal_libra/elastic_runtime")
_PATH_RE = re.compile(r"""["'](/(?:generate|update_weights\w*|get_weight_version|weight_version|health\w*|flush_cache|"""
                      r"""init_weights\w*|destroy_weights\w*|pause_generation|continue_generation|\w*model_info|\w*server_info|"""
                      r"""abort_request|update_weight_version))["']""")


def _sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (make setup-sglang installs it --no-deps)")
    return Path(spec.origin).parent


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")  # the installed distribution's metadata, without importing sglang


def _routes(pkg: Path) -> dict[str, ast.AsyncFunctionDef | ast.FunctionDef]:
    """path -> handler of every @app.get/post/put/api_route("...") in SGLang's HTTP server."""
    tree = ast.parse((pkg / "srt" / "entrypoints" / "http_server.py").read_text())
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app" and dec.args
                    and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                out[dec.args[0].value] = node
    return out


def _always_404(fn) -> bool:
    """A deprecated stub: its body only raises HTTPException(status_code=404, ...)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return False
    return any(k.arg == "status_code" and isinstance(k.value, ast.Constant) and k.value.value == 404
               for k in body[0].exc.keywords)


def _called_paths() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for d in CALLERS:
        for f in sorted((ROOT / d).rglob("*.py")):
            for line in f.read_text().splitlines():
                if ".add_get(" in line or ".add_post(" in line:  # a route this project serves (emulated host)
                    continue
                for m in _PATH_RE.finditer(line):
                    found.setdefault(m.group(1), []).append(str(f.relative_to(ROOT)))
    return found


def test_the_pinned_version_is_installed():
    _sglang_dir()
    assert _version() == PINNED
    assert f"sglang[tracing]=={PINNED}" in (ROOT / "requirements" / "gpu.txt").read_text()
    assert f"sglang=={PINNED}" in (ROOT / "requirements" / "sglang-cpu.txt").read_text()


def test_the_routes_are_read():
    routes = _routes(_sglang_dir())
    assert {"/generate", "/health", "/update_weights_from_disk", "/flush_cache"} <= set(routes)
    assert _always_404(routes["/get_weight_version"]) and not _always_404(routes["/generate"])


def _endpoint_cases():
    paths = _called_paths()
    assert {"/health", "/update_weights_from_disk"} <= set(paths)  # the grep finds the fleet's calls
    # (SGLang 0.5.10.post1 answers /get_weight_version with 404: the fleet reads GET /model_info's weight_version.)
    return sorted(paths)


@pytest.mark.parametrize("path", _endpoint_cases())
def test_every_path_we_call_exists_in_sglang(path):
    routes = _routes(_sglang_dir())
    assert path in routes, f"{path} (called in {_called_paths()[path]}) is not a route of sglang {PINNED}"
    assert not _always_404(routes[path]), f"{path} is a deprecated stub in sglang {PINNED} (always 404)"


# ---------------------------------------------------------------- the command lines

def parse_with_sglang(argvs: list[list[str]]) -> list[dict]:
    """Each server argv (after `-m sglang.launch_server`) parsed by the pinned SGLang's ServerArgs in a process
    of its own (areal_libra/rollout/sglang_args.py); skips, naming why, where sglang.srt.server_args does not
    import. A flag SGLang does not know fails the parse (SGLangArgsError: the test fails)."""
    _sglang_dir()
    try:
        return parse_command_lines(argvs)
    except SGLangUnavailable as e:
        pytest.skip(f"{e}; see requirements/sglang-cpu.txt")


def _gpu_command_lines(tmp_path) -> list[list[str]]:
    """What launch_servers starts for the GPU configs: cluster=gpu's default and one group per TP 1/2/4/8."""
    cmds = []
    allocs = [None, "sglang:d1t1", "sglang:d1t2", "sglang:d1t4", "sglang:d1t8", "sglang:d2t1+d1t2+d1t4"]
    for alloc in allocs:
        args = ["cluster=gpu", f"cluster.fileroot={tmp_path}"] + ([f"rollout_alloc={alloc}"] if alloc else [])
        specs = launch.server_specs(compose(args))
        for i, spec in enumerate(specs):
            port, dist = ports_in_range(2, *port_range(i, len(specs)))
            cmds.append(launcher.build_command("sglang", "/models/Qwen3-8B", spec, "127.0.0.1", port,
                                               dist_init_port=dist))
    cmds.append(launcher.build_command("sglang", "Qwen/Qwen3-1.7B", ServerSpec(tp=2, max_total_tokens=65536,
                                                                               seed=3), "127.0.0.1", 30000, 0, 30001))
    return cmds


def test_every_gpu_command_line_parses_with_sglangs_server_args(tmp_path):
    cmds = _gpu_command_lines(tmp_path)
    assert {c[c.index("--tp-size") + 1] for c in cmds} == {"1", "2", "4", "8"}
    assert all(cmd[1:3] == ["-m", "sglang.launch_server"] for cmd in cmds)
    for cmd, ns in zip(cmds, parse_with_sglang([cmd[3:] for cmd in cmds]), strict=True):
        assert ns["tp_size"] == int(cmd[cmd.index("--tp-size") + 1])
        assert ns["random_seed"] == int(cmd[cmd.index("--random-seed") + 1])
        assert ns["dist_init_addr"] == cmd[cmd.index("--dist-init-addr") + 1]
        assert ns["port"] == int(cmd[cmd.index("--port") + 1])


def test_the_runs_sglang_section_reaches_every_server_as_arealss_launcher_passes_it(tmp_path):
    """AReaL's `sglang:` keys (two overrides here, and cluster=gpu's radix cache kept on) are on the launch's
    command lines and on the fleet's later servers, and SGLang reads them; per-server flags are not repeated."""
    from areal_libra.rollout.backend import backend_for_device

    c = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}", "sglang.mem_fraction_static=0.7",
                 "sglang.context_length=16384"])
    specs = launch.server_specs(c)
    first = launcher.build_command("sglang", "/models/Qwen3-8B", specs[0], "127.0.0.1", 30000, 0, 30001)
    later = backend_for_device("cuda", seed=1, first_index=len(specs),
                               areal_flags=launcher.areal_sglang_flags(c.areal.sglang))
    [again] = later.commands("/models/Qwen3-8B", [ServerSpec(tp=2)], devices=[("0", "1")])
    for cmd in (first, again):
        assert cmd.count("--tp-size") == cmd.count("--random-seed") == cmd.count("--port") == 1
        ns = parse_with_sglang([cmd[3:]])[0]
        assert (ns["mem_fraction_static"], ns["context_length"], ns["disable_radix_cache"]) == (0.7, 16384, False)


def test_a_flag_sglang_does_not_know_is_refused_by_name():
    good = ["--model-path", "/models/Qwen3-8B", "--tp-size", "2"]
    assert parse_with_sglang([good])[0]["tp_size"] == 2
    with pytest.raises(SGLangArgsError, match="unrecognized arguments: --tp-sizes 2"):
        parse_command_lines([good, ["--model-path", "/models/Qwen3-8B", "--tp-sizes", "2"]])
    with pytest.raises(SGLangArgsError, match="--tp-size"):
        parse_command_lines([["--model-path", "/m", "--tp-size", "two"]])


def test_the_command_lines_carry_the_areal_flags(tmp_path):
    """Runs without SGLang's modules: what the parse test checks, seen from our side."""
    cmds = _gpu_command_lines(tmp_path)
    for cmd in cmds:
        for flag in ("--model-path", "--tp-size", "--random-seed", "--dist-init-addr", "--port", "--base-gpu-id"):
            assert flag in cmd, (flag, cmd)


@pytest.mark.parametrize("bound", [False, True])
def test_the_bounded_lag_turns_on_sglangs_priority_scheduling(tmp_path, bound):
    """libra.bound_lag: SGLang orders each waiting queue by the request priority the router sets (the
    trajectory's start version, lowest first), with the fcfs policy its priority scheduling requires
    (ServerArgs.check_server_args: fcfs or lof), overriding AReaL's lpm; off, AReaL's flags as they are."""
    c = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}", f"libra.bound_lag={str(bound).lower()}"])
    spec = launch.server_specs(c)[0]
    ns = parse_with_sglang([launcher.build_command("sglang", "/m", spec, "127.0.0.1", 30000, 0, 30001)[3:]])[0]
    got = (ns["enable_priority_scheduling"], ns["schedule_low_priority_values_first"],
           ns["disable_priority_preemption"])
    assert got == ((True, True, True) if bound else (False, False, False))
    assert ns["schedule_policy"] == ("fcfs" if bound else c.areal.sglang.schedule_policy)
