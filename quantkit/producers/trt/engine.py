"""Step 2: compile the TensorRT-LLM checkpoint into an engine with ``trtllm-build``, then load it and generate.

Only TensorRT-LLM releases up to 1.2 ship the engine builder; later ones removed the TensorRT engine backend and
their PyTorch runtime loads the unified Hugging Face checkpoint directly. TensorRT-LLM wheels are only on NVIDIA's
package index (and in NVIDIA's containers). So this step says, in one sentence, why it did not run when it did
not, and what was produced instead; ``status`` decides that before any work is done.

Written against TensorRT-LLM's documented ``trtllm-build`` flags and ``tensorrt_llm.runtime.ModelRunner``
(0.13 to 1.2); it has not run on this project's CPU machines, which cannot install TensorRT-LLM.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError
from quantkit.producers.trt import runner
from quantkit.producers.trt.pyenv import TrtEnvironment
from quantkit.producers.trt.runner import log_tail
from quantkit.progress import Reporter
from quantkit.formats.specs import TrtLimits

# Runs trtllm-build's own entry point with the chosen environment's Python (the console script may belong to
# another environment on PATH).
_BUILD = "import sys; from tensorrt_llm.commands.build import main; sys.exit(main())"
PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 8


@dataclass
class EngineStatus:
    """What step 2 did: ``ran`` (built, loaded, generated), ``built`` (multi-rank: not run here), ``skipped``
    (--checkpoint-only), ``unavailable`` (no TensorRT-LLM engine builder) or ``failed``."""

    status: str
    note: str
    command: list[str] = field(default_factory=list)
    generated: list[dict[str, Any]] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        return {"status": self.status, "note": self.note, "command": " ".join(self.command) or None,
                "generated": self.generated or None}


def build_args(limits: TrtLimits, checkpoint_dir: Path | str, engine_dir: Path | str, workers: int) -> list[str]:
    """trtllm-build's arguments for the recipe's limits."""
    return ["--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--max_batch_size", str(limits.max_batch_size), "--max_input_len", str(limits.max_input_len),
            "--max_seq_len", str(limits.max_seq_len), "--max_num_tokens", str(limits.max_num_tokens),
            "--kv_cache_type", "paged" if limits.paged_kv_cache else "continuous",
            "--gemm_plugin", limits.gemm_plugin or "disable", "--workers", str(workers)]


def status(env: TrtEnvironment, checkpoint_only: bool, limits: TrtLimits, world_size: int) -> EngineStatus | None:
    """Why step 2 will not run (``None`` when it will)."""
    later = ("trtllm-build " + " ".join(build_args(limits, "trtllm-ckpt", "engine", world_size)))
    produced = ("Produced instead: trtllm-ckpt/ (the TensorRT-LLM checkpoint; compile it where TensorRT-LLM <= 1.2 "
                f"and a GPU are available, from the artifact folder: `{later}`) and hf/ (the unified Hugging Face "
                "checkpoint, which vLLM with quantization=modelopt, SGLang and TensorRT-LLM's LLM API load).")
    if checkpoint_only:
        return EngineStatus("skipped", f"Engine not built: --checkpoint-only stops after step 1. {produced}")
    if not env.tensorrt_llm:
        return EngineStatus("unavailable", f"Engine not built: tensorrt_llm is not installed in {env.python} (its "
                            "wheels are only on NVIDIA's package index and in NVIDIA's TensorRT-LLM containers). "
                            + produced)
    if not env.engine_builder:
        version = env.versions.get("tensorrt_llm") or "?"
        return EngineStatus("unavailable", f"Engine not built: tensorrt_llm {version} in {env.python} has no engine "
                            "builder (trtllm-build was removed with the TensorRT engine backend); its PyTorch runtime "
                            "loads hf/ directly (`trtllm-serve hf` or `LLM(model='hf')`). " + produced)
    return None


def build(env: TrtEnvironment, checkpoint_dir: Path, engine_dir: Path, limits: TrtLimits, world_size: int,
          log: Path) -> list[str]:
    """Run trtllm-build; returns the command. Raises BackendError quoting its log when it fails."""
    cmd = [env.python, "-c", _BUILD, *build_args(limits, checkpoint_dir, engine_dir, world_size)]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not any(engine_dir.glob("rank*.engine")):
        raise BackendError(f"trtllm-build failed (exit status {proc.returncode})\n--- end of its log ---\n"
                           f"{log_tail(log)}", hint=f"the whole log is kept in {log}")
    return ["trtllm-build", *build_args(limits, checkpoint_dir.name, engine_dir.name, world_size)]


def generate(env: TrtEnvironment, engine_dir: Path, tokenizer: Any, workdir: Path,
             reporter: Reporter) -> list[dict[str, Any]]:
    """Load the engine with TensorRT-LLM's runtime (in its environment) and decode a few tokens per prompt."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    job = {"engine_dir": str(engine_dir), "prompts": prompts, "max_new_tokens": NEW_TOKENS, "end_id": eos,
           "pad_id": pad}
    events = runner.run(env.python, job, workdir, reporter, args=("--run-engine",),
                        what="loading the engine in TensorRT-LLM's runtime")
    out = []
    for text, ids in zip(PROMPTS, events["result"]["generated"]):
        if not ids:
            raise BackendError(f"the engine loaded but generated no token for {text!r}")
        out.append({"prompt": text, "tokens": len(ids), "text": tokenizer.decode(ids)})
    return out
