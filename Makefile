# Every target bootstraps what it needs on a fresh machine: a virtualenv in .venv, torch 2.13.0
# (CPU build, pinned: an unpinned torch pulls a multi-GB CUDA build), the tools of
# requirements-dev.txt, and the C++ extension. Nothing has to be installed by hand.
#
# On a GPU machine, `make CUDA=1 test|demo|bench` does the same in .venv-cuda with the registry's
# torch 2.13.0 CUDA build and builds the CUDA kernels too (nvcc of the same CUDA major as torch;
# archs from MOE_KERNELS_CUDA_ARCHS or TORCH_CUDA_ARCH_LIST, see setup.py). On a GPU machine that
# already has a CUDA torch (no internet needed), `make gpu-check PY=python3` builds, tests and
# benchmarks there without a venv. `make check-cuda-build` checks, without a GPU,
# that the CUDA build compiles, links and registers every CUDA kernel (slow: not in `make test`).
PYTHON ?= python3
CUDA   ?= 0
ifeq ($(CUDA),1)
VENV   ?= .venv-cuda
VARIANT := cuda
else
VENV   := .venv
VARIANT := cpu
endif
BIN    := $(VENV)/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.extension-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null) setup.py
# pip flags for the CUDA torch: --isolated ignores pip's configuration, so that a local CPU wheel
# or constraint configured there cannot stand in for the registry's CUDA build. Set it empty to
# keep your configuration (e.g. a mirror) when it has no such wheel.
TORCH_CUDA_PIP_FLAGS ?= --isolated
CUDA_CHECK_VENV ?= .venv-cuda-check
# The kernels' build is one compile job per file; raise on a machine with cores to spare.
MAX_JOBS ?= 2
export MAX_JOBS

.PHONY: all demo test test-kernels test-triton bench lint build clean gpu-check check-cuda-build FORCE

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

ifeq ($(CUDA),1)
$(DEPS): $(PY) requirements-dev.txt
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_CUDA_PIP_FLAGS) torch==2.13.0
	$(BIN)/pip install --quiet -r requirements-dev.txt
	@$(PY) -c "import torch; assert torch.version.cuda, 'CUDA=1 but a CPU torch was installed: see TORCH_CUDA_PIP_FLAGS'; print('torch', torch.__version__)"
	touch $@
else
$(DEPS): $(PY) requirements-dev.txt
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements-dev.txt
	@$(PY) -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed (on a GPU machine: make CUDA=1 ...)'; print('torch', torch.__version__)"
	touch $@
endif

# The extension: C++ CPU kernels (and, with CUDA=1, the CUDA ones); see setup.py. pip install -e
# puts the .so in the source tree, shared by .venv and .venv-cuda: moe_kernels/.extension-variant
# says which build it is, and switching CUDA= rebuilds.
ifneq ($(shell cat moe_kernels/.extension-variant 2>/dev/null),$(VARIANT))
$(EXT): FORCE
endif
$(EXT): $(DEPS) $(SOURCES)
	MOE_KERNELS_CUDA=$(CUDA) $(BIN)/pip install --quiet --no-build-isolation --no-deps -e .
	@$(PY) -c "import moe_kernels, moe_kernels._extension as e; assert e.LOADED, e.LOAD_ERROR; print('backends:', moe_kernels.backends())"
	echo $(VARIANT) > moe_kernels/.extension-variant
	touch $@

FORCE:

build: $(EXT)

# The suite runs twice: kernels and AOT/nvcc compiles, then the Triton kernels in the interpreter
# (TRITON_INTERPRET must be set before triton decorates any kernel, so it needs its own process).
test: $(EXT)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	MOE_KERNELS_CUDA=$(CUDA) MOE_KERNELS_REQUIRE_EXTENSION=1 $(PY) -m pytest python_tests -p no:cacheprovider
	TRITON_INTERPRET=1 MOE_KERNELS_REQUIRE_EXTENSION=1 $(PY) -m pytest python_tests -m triton -p no:cacheprovider

demo: $(EXT)
	$(PY) examples/demo.py

bench: $(EXT)
	$(if $(filter 1,$(CUDA)),MOE_KERNELS_BENCH_DEVICE=cuda) $(PY) bench/run_all.py

# On a GPU machine, offline: build in place against the installed torch (CUDA kernels for the GPU
# found), the GPU cases of the suite in parallel groups, the GPU benchmarks' quick grid; logs and
# report.md into GPU_OUT as it goes (bench/gpu_check.py). Uses the Python given as PY (default
# python3), creates no venv and installs nothing.
GPU_OUT ?= gpu-check-out
GPU_PY := $(if $(filter command line environment,$(origin PY)),$(PY),python3)
gpu-check:
	MAX_JOBS=$(if $(filter command line environment,$(origin MAX_JOBS)),$(MAX_JOBS),$$(nproc)) \
	$(GPU_PY) bench/gpu_check.py --out $(GPU_OUT) $(GPU_CHECK_FLAGS)

# Without a GPU: a venv with the registry's CUDA torch 2.13.0, the CUDA build of a copy of this
# tree (the tree's own .so and build/ stay untouched), then the suite on CPU, which includes the
# check that every op with a .cu kernel has a CUDA registration. A multi-GB download and a long
# compile (3 to 10 min on 2 cores): not part of `make test`.
check-cuda-build:
	test -x $(CUDA_CHECK_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_CHECK_VENV)
	$(CUDA_CHECK_VENV)/bin/pip install --quiet $(TORCH_CUDA_PIP_FLAGS) torch==2.13.0
	$(CUDA_CHECK_VENV)/bin/pip install --quiet -r requirements-dev.txt
	@$(CUDA_CHECK_VENV)/bin/python -c "import torch; assert torch.version.cuda, 'not a CUDA torch: see TORCH_CUDA_PIP_FLAGS'; print('torch', torch.__version__)"
	rm -rf $(CUDA_CHECK_VENV)/src && mkdir -p $(CUDA_CHECK_VENV)/src
	git ls-files -z --cached --others --exclude-standard | xargs -0 sh -c 'for f; do [ -f "$$f" ] && cp --parents "$$f" $(CUDA_CHECK_VENV)/src; done; true' sh
	cd $(CUDA_CHECK_VENV)/src && MOE_KERNELS_CUDA=1 $(abspath $(CUDA_CHECK_VENV))/bin/pip install --no-build-isolation --no-deps -e .
	cd $(CUDA_CHECK_VENV)/src && $(abspath $(CUDA_CHECK_VENV))/bin/python -c "import moe_kernels, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda); print('backends:', moe_kernels.backends())"
	cd $(CUDA_CHECK_VENV)/src && MOE_KERNELS_CUDA=1 MOE_KERNELS_REQUIRE_EXTENSION=1 $(abspath $(CUDA_CHECK_VENV))/bin/python -m pytest python_tests -q -p no:cacheprovider

lint: $(DEPS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf build *.egg-info moe_kernels/_C*.so moe_kernels/.extension-variant $(EXT)
