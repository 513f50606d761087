# quantkit: `make demo` runs the main job, `make test` the test suite. Both create/update .venv first.
# torch is installed first and pinned: torch==2.13.0 is a CPU build from a local file on these machines,
# and an unpinned torch would pull gigabytes of CUDA wheels.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0
# llama-cpp-python compiles from source (~10 min on 2 cores); pip caches the built wheel for the next install.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install install-trt test demo bench bench-gpu clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel setuptools
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q $(TORCH) -e '.[all,legacy,dev]'
	touch $@

test: install
	$(BIN)/python -m pytest -q -ra

demo: install
	$(BIN)/quantkit run recipes/demo.yaml --force

clean:
	rm -rf out release .pytest_cache
