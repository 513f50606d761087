# quantkit: `make demo` runs the main job, `make test` the test suite. Both create/update .venv first.
# torch is installed first and pinned: torch==2.13.0 is a CPU build from a local file on these machines,
# and an unpinned torch would pull gigabytes of CUDA wheels.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# llama-cpp-python compiles from source (~10 min on 2 cores); the wheel is built once into WHEELS and reused.
# It is built for AVX2 without GGML_NATIVE: a native build on a CPU with AMX repacks quantized weights for AMX,
# and llama.cpp's AMX path (0.3.36's vendored llama.cpp) crashes with SIGSEGV on the first quantized matmul.
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
WHEELS ?= $(HOME)/.cache/quantkit/wheels

.PHONY: install install-trt test demo bench bench-gpu clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel setuptools
	$(BIN)/python -m pip install -q $(TORCH)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip wheel -q --no-deps \
	    --no-cache-dir --no-binary llama-cpp-python -w $(WHEELS) $(LLAMA_CPP)
	$(BIN)/python -m pip install -q --find-links $(WHEELS) $(TORCH) $(LLAMA_CPP) -e '.[all,legacy,dev]'
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

# OpenMP threads that spin-wait slow torch's small CPU ops several-fold when cores are shared (servers, workers).
test: install install-trt
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -ra

demo: install
	$(BIN)/quantkit run recipes/demo.yaml --force

bench: install
	$(BIN)/python bench/run.py all

bench-gpu: install
	$(BIN)/python bench/quantize_cost.py --shape 8b

clean:
	rm -rf out release .pytest_cache
