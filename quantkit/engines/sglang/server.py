"""Hugging Face checkpoints (compressed-tensors, AutoAWQ, GPTQ, ModelOpt FP8, plain) in SGLang's HTTP server.

Written for SGLang 0.5.17 (the last release pinning torch 2.11.0, the H200 image's); every flag below is one its
``server_args.py`` defines. The command is ``PYTHON -m sglang.launch_server --model-path ARTIFACT ...``, so it works
where SGLang is installed with ``pip --target`` and has no ``sglang`` script; the engine's Python is ``--python``,
then ``QUANTKIT_SGLANG_PYTHON``, then the interpreter of ``sglang`` on PATH (:mod:`quantkit.envs`). ``/health``
answers 503 until the server's warm-up request has run, then 200.

Defaults are chosen for a smoke test, as vLLM's are: no CUDA graphs for decode or prefill (healthy sooner), a
context of at most 4096 tokens, 40% of GPU memory for weights and KV cache (``--mem-fraction-static``), seed 0,
SGLang's PyTorch sampler (greedy decoding is an argmax in either; FlashInfer's sampling kernels would be compiled
at first use), no grammar backend (no request is constrained; the xgrammar beside it is vLLM's, a different
version than SGLang pins) and a scheduler watchdog of 30 minutes instead of 5: in the H200's fourth run (six
servers starting at once) the AutoAWQ and GPTQ layouts' warm-up request ran past 300 s and the watchdog killed both
servers before they were healthy (bench/results/h200/sglang). SGLang 0.5.17 compiles its Marlin kernel
(``sglang.jit_kernel``, one build per activation dtype and weight type; these two are float16) inside that first
forward pass. quantkit's own health timeout is what bounds a start. ``--tp N`` becomes ``--tp-size N``. The
attention backend is SGLang's own choice (FA3 on Hopper); where its FA3 library is not installed, pass
``--server-arg=--attention-backend --server-arg=triton``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantkit.engines.serving import ServeOptions, Server
from quantkit.engines.vllm.server import max_model_len
from quantkit.formats.names import SGLANG

DEFAULT_MEM_FRACTION = 0.4
SEED = 0
WATCHDOG_S = 1800  # SGLang's own default is 300 s; see the module's docstring

# "Load weight end. elapsed=1.23 s, type=LlamaForCausalLM, quant=compressed-tensors, avail mem=..., mem usage=0.31 GB."
# (model_executor/model_runner.py); the quant= part comes from ModelConfig.get_quantization_config_log_str.
_LOADED = re.compile(r"Load weight end\. .*?type=(\w+), (?:quant=([\w-]+)[^,]*, )?.*?mem usage=([\d.]+) GB")
_ATTN = re.compile(r"\battention_backend='(\w+)'")
_QUANT_ARG = re.compile(r"server_args=ServerArgs\(.*?\bquantization='([\w-]+)'")
# Scheme and kernel choices SGLang logs at INFO: its MoE schemes ("Using CompressedTensorsW8A8Fp8MoE"), the AutoAWQ /
# GPTQ conversion to Marlin ("The model is convertible to awq_marlin during runtime. Using awq_marlin kernel.") and
# the fallback for layers Marlin cannot run ("Layer '...' is not supported by AWQMarlin. Falling back to ...").
_SCHEMES = re.compile(r"\b(Using \w*(?:CompressedTensors|Marlin|MoE)\w*|Using \w+ kernel|"
                      r"is not supported by \w+\. Falling back to [\w ]+)")
# "Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)" (managers/scheduler.py): a forward pass
# ran past the watchdog, and the server dies without a Python error of its own
_WATCHDOG = re.compile(r"Scheduler watchdog timeout \(self\.watchdog_timeout=([\d.]+)")
_ERROR = re.compile(r"^(?:\S.*?\s)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$", re.M)


class SglangServer(Server):
    name = SGLANG
    health_path = "/health"
    reads_compressed_tensors = True

    def command(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        return [python, "-m", "sglang.launch_server", "--model-path", str(target), "--host", host, "--port", str(port),
                "--context-length", str(max_model_len(target, opts.max_model_len)),
                "--mem-fraction-static", str(opts.gpu_memory_utilization or DEFAULT_MEM_FRACTION),
                "--tp-size", str(opts.tp), "--random-seed", str(SEED),
                "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
                "--sampling-backend", "pytorch", "--grammar-backend", "none", "--watchdog-timeout", str(WATCHDOG_S)]

    def speed_extra(self, max_tokens: int) -> dict[str, Any]:
        return {"min_tokens": max_tokens, "ignore_eos": True}

    def log_facts(self, log_text: str) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        if m := _LOADED.search(log_text):
            facts["model_class"] = m.group(1)
            if m.group(2):
                facts["quantization"] = m.group(2)
            facts["weights_gib"] = float(m.group(3))
        if "quantization" not in facts and (m := _QUANT_ARG.search(log_text)):
            facts["quantization"] = m.group(1)
        if m := _ATTN.search(log_text):
            facts["attention_backend"] = m.group(1)
        schemes = list(dict.fromkeys(s.strip() for s in _SCHEMES.findall(log_text)))
        if schemes:
            facts["schemes"] = schemes
        errors = _ERROR.findall(log_text)
        if errors:
            facts["error"] = errors[-1].strip()[:500]
        elif m := _WATCHDOG.search(log_text):
            facts["error"] = (f"SGLang's scheduler watchdog stopped a forward pass that ran past {m.group(1)} s "
                              "(--watchdog-timeout)")
        return facts


SERVER = SglangServer()
