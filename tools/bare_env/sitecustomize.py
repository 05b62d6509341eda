"""The bare GPU machine of tools/gpu_check.py, simulated in this venv: put this folder first on PYTHONPATH and
this venv's site-packages is replaced on sys.path by a folder of links to the distributions the device image
holds (their modules and their metadata, so `importlib.util.find_spec` and `importlib.metadata` agree that
the others are absent). The repository and a wheel bundle's --target folder stay importable.

The image's packages are /work/.library/device/KINDS.md's list for nvidia-h200 (as import names); versions
here are this venv's, not the image's (e.g. transformers 5.3 here, 5.17 there). BARE_ENV_ALLOW=a,b adds
import names (for the bundle's compiled wheels, which are built for the image's Python 3.12, not this one).
"""

from __future__ import annotations

import hashlib
import os
import site
import sys
import tempfile

# Import names of the image's packages (KINDS.md "Python packages already there").
GPU_IMAGE = frozenset("""
absl accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attr attrs botorch build certifi
charset_normalizer chex click cloudpickle cmake colorama contourpy coverage cuda cupy cycler Cython cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fontTools formulaic frozenlist fsspec
gpytorch grpc h11 h5py hf_xet httpcore httpx huggingface_hub humanize hypothesis idna imageio iniconfig
interface_meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy_loader lightning lightning_utilities
linear_operator lineax llvmlite lxml markdown markdown_it markupsafe matplotlib mpl_toolkits mdurl mesonbuild
ml_dtypes mpi4py mpmath msgpack multidict multipledispatch mypy_extensions nanobind narwhals networkx ninja
numba numba_cuda numpy numpyro nvidia pynvml onnx onnx_ir onnxruntime onnxscript cv2 optax opt_einsum
opt_einsum_fx optimistix orbax packaging pandas pathspec patsy peft PIL pip pluggy portalocker
prometheus_client propcache google psutil pyarrow pybind11 cpuinfo pygments pyre_extensions pytest
pytest_benchmark pytest_cov pytest_mock pytest_timeout xdist dateutil pytorch_lightning pyparsing
pyproject_hooks yaml regex requests rich sacrebleu safetensors scikit_build_core skimage sklearn scipy seaborn
sentencepiece sentence_transformers setuptools pkg_resources shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard_data_server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchgen functorch torchaudio torchdiffeq torch_geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing_extensions typing_inspect urllib3 uvloop wadler_lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())


def _tops(site_dir: str, dist_info: str) -> set[str]:
    """The top-level names a distribution installed (top_level.txt, else its RECORD's first components)."""
    base = os.path.join(site_dir, dist_info)
    try:
        with open(os.path.join(base, "top_level.txt"), encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}
    except OSError:
        pass
    try:
        with open(os.path.join(base, "RECORD"), encoding="utf-8") as f:
            first = {line.split(",", 1)[0].split("/", 1)[0] for line in f if line.strip()}
    except OSError:
        return set()
    return {n.split(".", 1)[0] for n in first if not n.endswith((".dist-info", ".data")) and n != ".."}


def _entry_name(entry: str) -> str:
    return entry.split(".", 1)[0] if not entry.endswith((".dist-info", ".egg-info")) else entry


def bare_site(site_dir: str, allow: frozenset[str]) -> str:
    """A folder of links to the entries of `site_dir` whose distribution provides an allowed name."""
    entries = sorted(os.listdir(site_dir))
    keep: set[str] = set(allow)
    for e in entries:
        if e.endswith(".dist-info"):
            tops = _tops(site_dir, e)
            if tops & allow:
                keep |= tops | {e}
    key = hashlib.sha256(("\n".join([site_dir, *sorted(keep), *entries])).encode()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"bare_env_site_{key}")
    if os.path.isdir(out):
        return out
    tmp = tempfile.mkdtemp(prefix="bare_env_site_", dir=tempfile.gettempdir())
    for e in entries:
        if e.endswith(".pth") or e.startswith("__editable__") or e == "__pycache__":
            continue
        if e in keep or _entry_name(e) in keep:
            os.symlink(os.path.join(site_dir, e), os.path.join(tmp, e))
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first
        pass
    return out if os.path.isdir(out) else tmp


def _install() -> None:
    allow = GPU_IMAGE | frozenset(n for n in os.environ.get("BARE_ENV_ALLOW", "").split(",") if n)
    real = {os.path.realpath(p) for p in site.getsitepackages()}
    new_path = []
    for p in sys.path:
        if os.path.realpath(p) in real:
            new_path.append(bare_site(p, allow))
        else:
            new_path.append(p)
    sys.path[:] = new_path
    # An editable install's finder (from a .pth) would still find this venv's own copy of a package.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]


_install()
