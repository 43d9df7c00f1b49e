# Every target bootstraps what it needs on a fresh machine: a virtualenv in .venv, torch 2.13.0
# (CPU build, pinned: an unpinned torch pulls a multi-GB CUDA build), the tools of
# requirements-dev.txt, and the C++ extension. Nothing has to be installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.extension-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null) setup.py

.PHONY: all demo test test-kernels test-triton bench lint build clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): $(PY) requirements-dev.txt
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements-dev.txt
	@$(PY) -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'; print('torch', torch.__version__)"
	touch $@

# The extension: C++ CPU kernels (and CUDA ones on a CUDA machine); see setup.py.
$(EXT): $(DEPS) $(SOURCES)
	$(BIN)/pip install --quiet --no-build-isolation --no-deps -e .
	@$(PY) -c "import moe_kernels, moe_kernels._extension as e; assert e.LOADED, e.LOAD_ERROR; print('backends:', moe_kernels.backends())"
	touch $@

build: $(EXT)

# The suite runs twice: kernels and AOT/nvcc compiles, then the Triton kernels in the interpreter
# (TRITON_INTERPRET must be set before triton decorates any kernel, so it needs its own process).
test: $(EXT)
	$(BIN)/ruff check .
	MOE_KERNELS_REQUIRE_EXTENSION=1 $(PY) -m pytest python_tests -p no:cacheprovider
	TRITON_INTERPRET=1 MOE_KERNELS_REQUIRE_EXTENSION=1 $(PY) -m pytest python_tests -m triton -p no:cacheprovider

demo: $(EXT)
	$(PY) examples/demo.py

bench: $(EXT)
	$(PY) bench/run_all.py

lint: $(DEPS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf build *.egg-info moe_kernels/_C*.so $(EXT)
