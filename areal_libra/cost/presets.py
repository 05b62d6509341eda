"""Hardware, model and cluster presets for the Cost Evaluator, loadable by name or from a user's YAML file.

Names resolve against areal_libra/presets/{hardware,models,clusters}.yaml; anything ending in .yaml/.yml
(or an existing path) is read as one spec. Every problem raises PresetError with one line naming it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from functools import cache, cached_property
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"


class PresetError(ValueError):
    """A preset that cannot be found or parsed; the message is one line naming the problem."""


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    flops: float  # dense bf16 peak FLOP/s per GPU
    hbm_bw: float  # bytes/s per GPU
    hbm_bytes: float  # device memory per GPU
    intra_bw: float  # bytes/s per GPU inside a node (NVLink)
    inter_bw: float  # bytes/s per GPU between nodes
    gpus_per_node: int = 8
    # Efficiency factors: what fraction of the peak a real kernel reaches (calibrated by cost.calibrate).
    hbm_eff: float = 0.80  # decode: achieved / peak HBM bandwidth
    decode_mfu: float = 0.35  # decode at large batch is compute bound at this MFU
    prefill_mfu: float = 0.55
    train_mfu: float = 0.45
    comm_eff: float = 0.80  # achieved / peak link bandwidth for collectives
    comm_latency_s: float = 10e-6  # per collective call
    step_overhead_s: float = 1.5e-3  # per decode step: scheduling, sampling, launch
    seq_overhead_s: float = 0.0  # per running request per decode step (host-side bookkeeping); calibrated
    prefill_overhead_s: float = 5e-3  # per prefill call
    # Per layer of the model (fitted from one layer's timings, cost.layer_fit): what a layer costs beyond its
    # roofline share (kernel launches and tails); whole model = n_layers x these + the per-step/call terms.
    decode_layer_overhead_s: float = 0.0  # per layer per decode step
    prefill_layer_overhead_s: float = 0.0  # per layer per prefill call
    workspace_bytes: float = 8e9  # per GPU: activations, CUDA graphs, NCCL buffers (not KV, not weights)

    def link_bw(self, group: int, span: int) -> float:
        """Effective per-GPU bandwidth for a collective over `group` ranks that spans `span` consecutive GPUs
        (inside one node when span <= gpus_per_node)."""
        bw = self.intra_bw if span <= self.gpus_per_node else self.inter_bw
        return bw * self.comm_eff

    def replace(self, **kw: Any) -> HardwareSpec:
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int  # dense MLP intermediate size (0 if all layers are MoE)
    vocab: int
    tie_embeddings: bool = False
    n_experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0  # per-expert intermediate size
    dtype_bytes: int = 2

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @cached_property
    def attn_params_per_layer(self) -> int:
        q = self.hidden * self.n_heads * self.head_dim
        kv = 2 * self.hidden * self.n_kv_heads * self.head_dim
        o = self.n_heads * self.head_dim * self.hidden
        return q + kv + o + 2 * self.hidden  # + the two RMSNorm weights

    @cached_property
    def expert_params(self) -> int:
        """Parameters of all routed experts, all layers."""
        return self.n_layers * self.n_experts * 3 * self.hidden * self.moe_ffn

    @cached_property
    def dense_params(self) -> int:
        """Everything that is not a routed expert (attention, dense MLP, router, embeddings)."""
        per_layer = self.attn_params_per_layer + 3 * self.hidden * self.ffn + self.hidden * self.n_experts
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb

    @cached_property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @cached_property
    def active_params(self) -> int:
        """Parameters one token touches (all of them for a dense model)."""
        if not self.is_moe:
            return self.params
        return self.dense_params + self.n_layers * self.experts_per_token * 3 * self.hidden * self.moe_ffn

    @cached_property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, all KV heads."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_dim(self) -> int:
        return self.n_heads * self.head_dim


@dataclass(frozen=True)
class ClusterSpec:
    hardware: HardwareSpec
    nodes: int
    gpus_per_node: int
    name: str = ""

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


# ---------------------------------------------------------------- loading


def _is_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml")) or "/" in ref or Path(ref).is_file()


def _read_yaml(path: Path) -> Any:
    import yaml

    if not path.is_file():
        raise PresetError(f"{path}: no such preset file")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PresetError(f"{path}{where}: malformed YAML ({problem})") from None
    except OSError as e:
        raise PresetError(f"{path}: cannot read ({e.strerror})") from None


@cache
def _builtin(kind: str) -> dict[str, dict]:
    data = _read_yaml(PRESET_DIR / f"{kind}.yaml")
    if not isinstance(data, dict):
        raise PresetError(f"{PRESET_DIR / kind}.yaml: expected a mapping of preset names")
    return data


def _build(cls: type, name: str, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise PresetError(f"{where}: a {cls.__name__} must be a mapping of fields, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    raw = {k: v for k, v in raw.items() if k not in ("kind",)}
    raw.setdefault("name", name)
    for k in raw:
        if k not in known:
            raise PresetError(f"{where}: unknown field '{k}' for {cls.__name__}")
    kw: dict[str, Any] = {}
    for k, f in known.items():
        if k not in raw:
            if f.default is dataclasses.MISSING:
                raise PresetError(f"{where}: missing field '{k}' for {cls.__name__}")
            continue
        v = raw[k]
        typ = f.type if isinstance(f.type, str) else f.type.__name__
        try:
            if typ == "bool":
                if not isinstance(v, bool):
                    raise TypeError
            elif typ == "int":
                if isinstance(v, bool) or float(v) != int(float(v)):
                    raise TypeError
                v = int(float(v))
            elif typ == "float":
                if isinstance(v, bool):
                    raise TypeError
                v = float(v)
            elif typ == "str":
                v = str(v)
        except (TypeError, ValueError):
            raise PresetError(f"{where}: field '{k}' must be {typ}, got {v!r}") from None
        if typ in ("int", "float") and v < 0:
            raise PresetError(f"{where}: field '{k}' must be >= 0, got {v!r}")
        kw[k] = v
    return cls(**kw)


def _validate_hw(hw: HardwareSpec, where: str) -> HardwareSpec:
    for k in ("flops", "hbm_bw", "hbm_bytes", "intra_bw", "inter_bw", "gpus_per_node"):
        if getattr(hw, k) <= 0:
            raise PresetError(f"{where}: field '{k}' must be > 0")
    for k in ("hbm_eff", "decode_mfu", "prefill_mfu", "train_mfu", "comm_eff"):
        if not 0 < getattr(hw, k) <= 1:
            raise PresetError(f"{where}: field '{k}' must be in (0, 1], got {getattr(hw, k)}")
    return hw


def _validate_model(m: ModelSpec, where: str) -> ModelSpec:
    for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab"):
        if getattr(m, k) <= 0:
            raise PresetError(f"{where}: field '{k}' must be > 0")
    if m.ffn <= 0 and not m.is_moe:
        raise PresetError(f"{where}: a dense model needs ffn > 0")
    if m.is_moe and (m.moe_ffn <= 0 or not 0 < m.experts_per_token <= m.n_experts):
        raise PresetError(f"{where}: an MoE model needs moe_ffn > 0 and 0 < experts_per_token <= n_experts")
    if m.n_heads % m.n_kv_heads:
        raise PresetError(f"{where}: n_heads ({m.n_heads}) must be a multiple of n_kv_heads ({m.n_kv_heads})")
    return m


def _names(kind: str) -> str:
    return ", ".join(sorted(_builtin(kind)))


def load_hardware(ref: str | HardwareSpec) -> HardwareSpec:
    """A hardware preset by name (a800, a100, h100, h200, cpu) or a YAML file holding one spec."""
    if isinstance(ref, HardwareSpec):
        return ref
    ref = str(ref)
    if _is_path(ref):
        p = Path(ref)
        return _validate_hw(_build(HardwareSpec, p.stem, _read_yaml(p), str(p)), str(p))
    key = ref.lower()
    if key not in _builtin("hardware"):
        raise PresetError(f"unknown hardware preset '{ref}' (known: {_names('hardware')}; or a YAML path)")
    return _validate_hw(_build(HardwareSpec, key, _builtin("hardware")[key], f"hardware preset '{key}'"), key)


def load_model(ref: str | ModelSpec) -> ModelSpec:
    """A model preset by name (qwen2.5-7b, qwen3-4b, qwen3-14b, qwen3-32b, qwen3-30b-a3b, ...) or a YAML
    file holding one spec."""
    if isinstance(ref, ModelSpec):
        return ref
    ref = str(ref)
    if _is_path(ref):
        p = Path(ref)
        return _validate_model(_build(ModelSpec, p.stem, _read_yaml(p), str(p)), str(p))
    key = ref.lower()
    if key not in _builtin("models"):
        raise PresetError(f"unknown model preset '{ref}' (known: {_names('models')}; or a YAML path)")
    return _validate_model(_build(ModelSpec, key, _builtin("models")[key], f"model preset '{key}'"), key)


_CLUSTER_RE = re.compile(r"^([a-z0-9_.-]+?)x(\d+)$")


def _cluster_from_mapping(raw: Any, name: str, where: str) -> ClusterSpec:
    if not isinstance(raw, dict):
        raise PresetError(f"{where}: a cluster must be a mapping with hardware, nodes, gpus_per_node")
    extra = set(raw) - {"hardware", "nodes", "gpus_per_node", "name", "kind"}
    if extra:
        raise PresetError(f"{where}: unknown field '{sorted(extra)[0]}' for a cluster")
    if "hardware" not in raw:
        raise PresetError(f"{where}: missing field 'hardware'")
    hw_raw = raw["hardware"]
    hw = _validate_hw(_build(HardwareSpec, name, hw_raw, where), where) if isinstance(hw_raw, dict) else (
        load_hardware(str(hw_raw))
    )
    gpn = raw.get("gpus_per_node", hw.gpus_per_node)
    nodes = raw.get("nodes", 1)
    for k, v in (("nodes", nodes), ("gpus_per_node", gpn)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PresetError(f"{where}: field '{k}' must be an integer >= 1, got {v!r}")
    if gpn > hw.gpus_per_node:
        raise PresetError(f"{where}: gpus_per_node {gpn} exceeds the {hw.name} node size {hw.gpus_per_node}")
    return ClusterSpec(hardware=hw.replace(gpus_per_node=gpn), nodes=nodes, gpus_per_node=gpn,
                       name=str(raw.get("name", name)))


def load_cluster(ref: str | ClusterSpec) -> ClusterSpec:
    """A cluster by preset name (a800x48, cpu, ...), by '<hardware>x<N>' (N GPUs, filled node by node), or
    a YAML file {hardware: NAME or mapping, nodes: int, gpus_per_node: int}."""
    if isinstance(ref, ClusterSpec):
        return ref
    ref = str(ref)
    if _is_path(ref):
        p = Path(ref)
        return _cluster_from_mapping(_read_yaml(p), p.stem, str(p))
    key = ref.lower()
    if key in _builtin("clusters"):
        return _cluster_from_mapping(_builtin("clusters")[key], key, f"cluster preset '{key}'")
    m = _CLUSTER_RE.match(key)
    if not m:
        raise PresetError(
            f"unknown cluster '{ref}' (known: {_names('clusters')}, '<hardware>x<N>' such as h100x16, or a YAML path)"
        )
    hw = load_hardware(m.group(1))
    n = int(m.group(2))
    if n < 1:
        raise PresetError(f"cluster '{ref}' has zero GPUs; it needs at least 1")
    gpn = min(n, hw.gpus_per_node)
    if n % gpn:
        raise PresetError(f"cluster '{ref}': {n} GPUs do not fill whole {hw.name} nodes of {hw.gpus_per_node}")
    return ClusterSpec(hardware=hw.replace(gpus_per_node=gpn), nodes=n // gpn, gpus_per_node=gpn, name=key)


# ---------------------------------------------------------------- the machine's own preset

# torch.cuda.get_device_name() -> hardware preset. Only models whose spec sheet matches a preset: the PCIe
# and NVL H100s, a 40 GB A100 and anything else differ in FLOP/s, bandwidth or memory and get no guess.
_DEVICE_PRESETS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bH200\b", re.I), "h200-fitted"),  # the H200 preset fitted to a measured layer table
    (re.compile(r"\bH100\b(?!.*\b(PCIe|NVL)\b).*(80\s*GB|HBM3|SXM)", re.I), "h100"),
    (re.compile(r"\bA800\b.*80\s*GB", re.I), "a800"),
    (re.compile(r"\bA100\b.*80\s*GB", re.I), "a100"),
)
AUTO = "auto"


def cluster_for_devices(names: list[str]) -> str:
    """The cluster preset name for these GPUs (one node: '<hardware>x<count>', e.g. 'h200-fittedx8'); 'cpu'
    when there are none. A GPU model without a preset, or a mix of models, raises PresetError (one line
    asking for a preset)."""
    if not names:
        return "cpu"
    kinds = sorted(set(names))
    if len(kinds) > 1:
        raise PresetError(f"this node mixes GPU models ({', '.join(kinds)}); set libra.control.cluster to a "
                          "cluster preset or a cluster YAML")
    for pattern, hw in _DEVICE_PRESETS:
        if pattern.search(kinds[0]):
            return f"{hw}x{len(names)}"
    raise PresetError(f"no cost preset for GPU '{kinds[0]}' x{len(names)}; set libra.control.cluster to a "
                      f"cluster preset ({_names('clusters')}, '<hardware>x<N>') or a cluster YAML "
                      "(python -m areal_libra.cost.profile --device cuda fits one)")


def detect_cluster() -> str:
    """cluster_for_devices of this machine's visible CUDA devices (torch.cuda); 'cpu' without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken torch or driver: no usable GPUs
        return "cpu"
    return cluster_for_devices(names)


def resolve_cluster_name(name: str, device: str = "cuda") -> str:
    """`libra.control.cluster`: 'auto' -> the machine's preset on a cuda run, the cpu preset on the embedded
    CPU cluster (device 'cpu', even on a GPU machine); any other name as given."""
    if str(name).lower() != AUTO:
        return str(name)
    return "cpu" if device != "cuda" else detect_cluster()
