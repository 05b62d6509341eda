"""AReaL installed behind a symlink (a symlinked .venv): its hydra config loading must still find the
experiment's config directory (patch 12). The unpatched copy shows the test can fail."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra import patches

_LOAD = (
    "import sys; from areal.api.cli_args import parse_cli_args; "
    "cfg, _ = parse_cli_args(['--config', sys.argv[1], 'trial.x=3']); print('x =', cfg.trial.x)"
)


def _install_behind_symlink(tmp_path: Path, *, with_fix: bool) -> Path:
    """Copy the installed areal three directory levels deep and reach it through a one-level symlink."""
    real = tmp_path / "real" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(Path(patches.find_areal_root(None)) / "areal", real / "areal",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if not with_fix:
        patches.revert(real, [p for p in patches.load_patches() if p.name.startswith("12-")])
    link = tmp_path / "venv"
    link.symlink_to(real, target_is_directory=True)
    return link


@pytest.mark.parametrize("with_fix", [True, False], ids=["patched", "unpatched"])
def test_config_loads_through_symlinked_install(tmp_path: Path, with_fix: bool) -> None:
    site = _install_behind_symlink(tmp_path, with_fix=with_fix)
    cfg = tmp_path / "exp" / "run.yaml"
    cfg.parent.mkdir()
    cfg.write_text("trial:\n  x: 1\n")
    r = subprocess.run([sys.executable, "-c", _LOAD, str(cfg)], capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    if with_fix:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "x = 3" in r.stdout
    else:  # the cause the patch removes: hydra looks one level off
        assert r.returncode != 0 and "MissingConfigException" in r.stderr
