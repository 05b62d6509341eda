# make run  : the default experiment (dapo_math on the embedded CPU cluster, or GPUs when present)
# make test : the test suite
# Both create or reuse .venv/ (Python 3.11). Stamps make a second call a no-op.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check -q
ARGS ?=

.PHONY: run test setup setup-sglang setup-gpu gpu-bundle lint bench clean
setup: $(VENV)/.stamp-patches

$(VENV)/.stamp-venv:
	$(PY) -m venv $(VENV)
	touch $@

$(VENV)/.stamp-deps: $(VENV)/.stamp-venv requirements/cpu.txt
	@echo ">> installing torch 2.13.0 (CPU), areal 1.0.4 (--no-deps) and requirements/cpu.txt"
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps areal==1.0.4
	$(PIP) install -r requirements/cpu.txt -r requirements/dev.txt torch==2.13.0
	touch $@

$(VENV)/.stamp-project: $(VENV)/.stamp-deps setup.py $(wildcard csrc/*.cpp csrc/*.h)
	@echo ">> installing areal_libra (editable; C++ extensions when a compiler is present)"
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.stamp-patches: $(VENV)/.stamp-project $(wildcard patches/areal-1.0.4/*.patch)
	@echo ">> applying patches/areal-1.0.4 to the installed AReaL"
	$(BIN)/python -m areal_libra.patches apply
	touch $@

# A GPU node: requirements/gpu.txt (AReaL's areal[cuda], SGLang, megatron-core) in its own venv on Python
# 3.12 with CUDA 12.9 wheels; GPU_INDEX names PyTorch's cu129 wheel index (--extra-index-url URL).
# On a CUDA machine without it, `make run` stops with one line saying to run this.
GPU_PY ?= python3.12
GPU_INDEX ?=
setup-gpu: $(VENV)/.stamp-gpu
$(VENV)/.stamp-gpu: requirements/gpu.txt
	test -x $(BIN)/python || $(GPU_PY) -m venv $(VENV)
	@echo ">> installing requirements/gpu.txt (CUDA), areal_libra and the AReaL patches"
	$(PIP) install $(GPU_INDEX) -r requirements/gpu.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	$(BIN)/python -m areal_libra.patches apply
	touch $@

run: $(if $(wildcard $(VENV)/.stamp-gpu),,setup)
	$(BIN)/python -m areal_libra.launch experiment=dapo_math $(ARGS)

# SGLang without its dependencies (6 MB, never a second torch): tests/sglang checks our command lines and
# HTTP calls against the pinned version (requirements/sglang-cpu.txt says what can and cannot import on CPU).
setup-sglang: $(VENV)/.stamp-sglang
$(VENV)/.stamp-sglang: $(VENV)/.stamp-patches requirements/sglang-cpu.txt
	@echo ">> installing sglang 0.5.10.post1 (--no-deps) for tests/sglang"
	$(PIP) install --no-deps -r requirements/sglang-cpu.txt
	touch $@

# tools/gpu_check.py's bundle for a bare GPU machine (docs/gpu.md, "GPU check script"): Python 3.12 x86-64 wheels of
# requirements/gpu-check.txt (--no-deps) and the tiny model in .gpu_bundle/ (ignored), at most 64 MiB: what the
# device tool carries (carry .gpu_bundle).
gpu-bundle: .gpu_bundle/.stamp
.gpu_bundle/.stamp: requirements/gpu-check.txt tools/gpu_check.py | $(VENV)/.stamp-patches
	$(BIN)/python tools/gpu_check.py --make-bundle requirements/gpu-check.txt --bundle .gpu_bundle
	touch $@

test: setup setup-sglang
	$(BIN)/python -m pytest -q -x --durations=15 $(ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
