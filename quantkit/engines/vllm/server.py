"""Hugging Face checkpoints (compressed-tensors, AutoAWQ, GPTQ, plain) in vLLM's OpenAI-compatible server.

Written for vLLM 0.26.0 (which reads compressed-tensors 0.17.0) on an H200; the command is
``PYTHON -m vllm.entrypoints.cli.main serve ARTIFACT ...`` so it also works where vLLM is installed with
``pip --target`` and has no ``vllm`` script on PATH. The engine's Python is ``--python``, then
``QUANTKIT_VLLM_PYTHON``, then the interpreter of ``vllm`` on PATH. Variables such as ``PYTHONPATH`` (vLLM's
own site folder) and ``VLLM_USE_FLASHINFER_SAMPLER=0`` reach the server through ``--env KEY=VALUE``.

Defaults are chosen for a smoke test, not for throughput: ``--enforce-eager`` (no CUDA-graph capture or
torch.compile: healthy in about half the time), a context of at most 4096 tokens and 40% of GPU memory, and
``--generation-config vllm`` so the model's generation_config.json defaults (repetition penalty...) do not
change the greedy answer compared against the baseline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantkit.engines.serving import ServeOptions, Server
from quantkit.checkpoint import read_config
from quantkit.formats.names import VLLM

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_GPU_MEMORY_UTILIZATION = 0.4

# Log lines naming the linear kernel vLLM chose, e.g. "Using MarlinLinearKernel for CompressedTensorsWNA16",
# "Selected CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8".
_KERNEL = re.compile(r"(?:Using|Selected) (\w*(?:Kernel|Marlin|Machete|Cutlass|Exllama|Triton)\w*) for (\w+)")
_SCHEME = re.compile(r"\b(CompressedTensors(?:W\d|WNA|24)\w*)")
_QUANT = re.compile(r"quantization=([\w-]+)")
_ATTN = re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+)(?: attention)? backend")
_ERROR = re.compile(r"^(?:\S.*?\s)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$", re.M)


def max_model_len(artifact: Path, asked: int | None) -> int:
    """``asked``, or the model's own context capped at 4096 (a smoke test needs no 128k KV cache)."""
    if asked:
        return asked
    cfg = read_config(artifact)
    cfg = cfg.get("text_config") or cfg
    return min(DEFAULT_MAX_MODEL_LEN, int(cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN))


class VllmServer(Server):
    name = VLLM
    health_path = "/health"
    reads_compressed_tensors = True

    def command(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", str(target), "--host", host, "--port", str(port),
                "--max-model-len", str(max_model_len(target, opts.max_model_len)),
                "--gpu-memory-utilization", str(opts.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION),
                "--enforce-eager", "--generation-config", "vllm", "--seed", "0",
                *(["--tensor-parallel-size", str(opts.tp)] if opts.tp > 1 else [])]

    def speed_extra(self, max_tokens: int) -> dict[str, Any]:
        return {"min_tokens": max_tokens, "ignore_eos": True}

    def log_facts(self, log_text: str) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        if m := _QUANT.search(log_text):
            facts["quantization"] = m.group(1)
        kernels = list(dict.fromkeys(f"{k} for {layer}" for k, layer in _KERNEL.findall(log_text)))
        if kernels:
            facts["kernels"] = kernels
        schemes = list(dict.fromkeys(_SCHEME.findall(log_text)))
        if schemes:
            facts["schemes"] = schemes
        if m := _ATTN.search(log_text):
            facts["attention_backend"] = m.group(1)
        errors = _ERROR.findall(log_text)
        if errors:
            facts["error"] = errors[-1].strip()[:500]
        return facts


SERVER = VllmServer()
