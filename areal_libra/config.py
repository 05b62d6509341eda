"""Compose and validate an experiment config: hydra tree under experiments/, AReaL key names.

The composed tree has AReaL 1.0.4 `GRPOConfig` keys at the top level and this project's keys under
`libra:`. AReaL keys are validated against AReaL's own dataclasses, so an unknown key is an error.
"""

from __future__ import annotations

import getpass
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONFIG_DIR = Path(__file__).resolve().parent.parent / "experiments"
GROUPS = ("experiment", "cluster", "model")


class ConfigError(ValueError):
    """A bad experiment name, override or value; the message is one line for the user."""


@dataclass
class Composed:
    areal: DictConfig  # validated against areal.api.cli_args.GRPOConfig
    libra: DictConfig
    choices: dict[str, str]

    @property
    def log_dir(self) -> Path:
        c = self.areal
        return Path(f"{c.cluster.fileroot}/logs/{getpass.getuser()}/{c.experiment_name}/{c.trial_name}")


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _split(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    choices, rest = {}, []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not of the form key=value")
        key, val = ov.split("=", 1)
        key = key.lstrip("+")
        if key in GROUPS:
            if val not in available(key):
                raise ConfigError(f"unknown {key} '{val}' (available: {', '.join(available(key))})")
            choices[key] = val
        else:
            rest.append(f"{key}={val}")
    return choices, rest


def compose(overrides: list[str], default_cluster: str = "cpu") -> Composed:
    from areal.api.cli_args import GRPOConfig
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    choices, rest = _split(overrides)
    choices.setdefault("cluster", default_cluster)
    choices.setdefault("experiment", "dapo_math")
    choices.setdefault("model", "tiny_qwen2")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = hydra_compose(config_name="config", overrides=[f"{k}={v}" for k, v in choices.items()])
    OmegaConf.set_struct(raw, False)
    libra = raw.pop("libra", OmegaConf.create({}))
    schema = OmegaConf.structured(GRPOConfig)
    try:
        areal = OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"experiment config does not match AReaL's GRPOConfig: {_msg(e)}") from None
    OmegaConf.set_struct(areal, True)
    OmegaConf.set_struct(libra, True)
    has_trial = False
    for ov in rest:
        key, val = ov.split("=", 1)
        has_trial |= key == "trial_name"
        # AReaL keys keep AReaL's names; project keys may be given with or without `libra.`.
        if key.startswith("libra."):
            libra = _override(libra, key[len("libra.") :], val, ov)
            continue
        try:
            areal = _override(areal, key, val, ov)
        except _UnknownKey:
            try:
                libra = _override(libra, key, val, ov)
            except _UnknownKey:
                raise ConfigError(
                    f"unknown config key '{key}' (neither an AReaL GRPOConfig key nor a libra key)"
                ) from None
    if not has_trial:
        areal.trial_name = time.strftime("t%Y%m%d_%H%M%S")
    # Mirror the root trial/experiment names into every sub-config that carries them.
    for sect in ("rollout", "actor", "saver", "recover", "evaluator", "stats_logger"):
        if sect in areal and areal[sect] is not None and "trial_name" in areal[sect]:
            areal[sect].trial_name = areal.trial_name
            areal[sect].experiment_name = areal.experiment_name
    try:
        OmegaConf.resolve(areal)
        OmegaConf.resolve(libra)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config cannot be resolved: {_msg(e)}") from None
    return Composed(areal=areal, libra=libra, choices=choices)


class _UnknownKey(ConfigError):
    pass


def _override(cfg: DictConfig, key: str, val: str, ov: str) -> DictConfig:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}={val}"]))
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise _UnknownKey(f"unknown config key '{key}': {_msg(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad override '{ov}': {_msg(e)}") from None


def _msg(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return first


def save(composed: Composed, run_dir: Path) -> tuple[Path, Path]:
    """Write the AReaL config and the project's config where the trainer reads them (atomic)."""
    from areal_libra.utils import atomic_write_text

    run_dir.mkdir(parents=True, exist_ok=True)
    a, b = run_dir / "areal_config.yaml", run_dir / "libra_config.yaml"
    atomic_write_text(a, OmegaConf.to_yaml(composed.areal))
    atomic_write_text(b, OmegaConf.to_yaml(composed.libra))
    return a, b
