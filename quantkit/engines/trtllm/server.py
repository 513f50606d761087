"""TensorRT-LLM engines and ModelOpt checkpoints in ``trtllm-serve`` (TensorRT-LLM's OpenAI-compatible server).

NOT TESTED: no TensorRT-LLM was available where this was written (no GPU, no TensorRT-LLM wheel). It follows
``trtllm-serve``'s documented command line (TensorRT-LLM 0.18 to 1.x): ``trtllm-serve MODEL --host --port
--backend {pytorch,tensorrt} --tokenizer PATH --max_seq_len N --kv_cache_free_gpu_memory_fraction F``, and its
``/health`` endpoint. A folder built by ``trtllm-build`` (``rank0.engine``) runs on the ``tensorrt`` backend and
needs a tokenizer (the folder's own, else the source model recorded in quantkit.json); a ModelOpt unified
Hugging Face checkpoint (``hf_quant_config.json``) runs on the ``pytorch`` backend and carries its tokenizer.
The engine's Python is ``--python``, then ``QUANTKIT_TRTLLM_PYTHON``, then the interpreter of ``trtllm-serve``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantkit.engines.serving import ServeOptions, Server
from quantkit.errors import QuantkitError
from quantkit.formats.names import TRTLLM
from quantkit.manifest import read_manifest

DEFAULT_KV_FRACTION = 0.4
# trtllm-serve's console-script entry point, called through the engine's Python (the module has no __main__).
_MAIN = "from tensorrt_llm.commands.serve import main; main()"


def is_engine_dir(path: Path) -> bool:
    """A folder written by ``trtllm-build``: serialized engines, one per rank."""
    return any(path.glob("rank*.engine"))


def tokenizer_dir(path: Path) -> Path | None:
    """Where the tokenizer of an engine folder lives: the folder itself, else the manifest's source model."""
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        return path
    try:
        src = read_manifest(path).source
    except QuantkitError:  # no manifest, or one that is not quantkit's: no tokenizer to point at
        return None
    p = Path(src.path)
    return p if src.path and p.exists() else None


class TrtllmServer(Server):
    name = TRTLLM
    health_path = "/health"

    def has_chat_template(self, target: Path) -> bool:
        tok = tokenizer_dir(target) if is_engine_dir(target) else target
        return tok is not None and super().has_chat_template(tok)

    def command(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        engine_dir = is_engine_dir(target)
        argv = [python, "-c", _MAIN, str(target), "--host", host, "--port", str(port),
                "--backend", "tensorrt" if engine_dir else "pytorch",
                "--kv_cache_free_gpu_memory_fraction", str(opts.gpu_memory_utilization or DEFAULT_KV_FRACTION)]
        if engine_dir and (tok := tokenizer_dir(target)):
            argv += ["--tokenizer", str(tok)]
        if opts.max_model_len:
            argv += ["--max_seq_len", str(opts.max_model_len)]
        if opts.tp > 1:
            argv += ["--tp_size", str(opts.tp)]
        return argv

    def log_facts(self, log_text: str) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        if m := re.search(r"quant_algo[\"']?\s*[:=]\s*[\"']?(\w+)", log_text):
            facts["quant_algo"] = m.group(1)
        errors = re.findall(r"^(?:\S.*?\s)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$", log_text, re.M)
        if errors:
            facts["error"] = errors[-1].strip()[:500]
        return facts


SERVER = TrtllmServer()
