"""The bare GPU machine of tools/gpu_check.py, simulated in this venv: put this folder first on PYTHONPATH
and every import of a third-party package that the device image does not hold raises ModuleNotFoundError,
unless it comes from outside this venv's site-packages (the repository, the wheel bundle's --target folder).

The image's packages are /work/.library/device/KINDS.md's list for nvidia-h200 (as import names); their
versions here are this venv's, not the image's (e.g. transformers 5.3 here, 5.17 there).
"""

from __future__ import annotations

import importlib.machinery
import os
import site
import sys

# Import names of the image's packages (KINDS.md "Python packages already there"), plus the modules that
# those distributions install under other names.
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

_ROOTS = tuple(os.path.realpath(p) + os.sep for p in site.getsitepackages())


class BareImage:
    """A meta-path finder that refuses top-level packages of this venv that the GPU image lacks."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name or name.startswith("_") or name in sys.stdlib_module_names:
            return None
        if name in GPU_IMAGE or name in os.environ.get("BARE_ENV_ALLOW", "").split(","):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is None:
            return None
        where = spec.origin if spec.origin not in (None, "namespace") else next(
            iter(spec.submodule_search_locations or []), "")
        if os.path.realpath(where).startswith(_ROOTS):
            raise ModuleNotFoundError(f"No module named {name!r} (not on the bare GPU image)", name=name)
        return None


sys.meta_path.insert(0, BareImage())
