"""The half of the TensorRT-LLM producer that runs inside the ModelOpt environment (a subprocess).

Why a subprocess: nvidia-modelopt[hf] 0.47 pins transformers < 5.15 while llm-compressor 0.14 needs >= 5.15, so
ModelOpt lives in its own Python environment (``.venv-trt``, or an NVIDIA TensorRT-LLM image). quantkit itself
may not be installed there, so this file imports nothing of quantkit: only the standard library, torch,
transformers, safetensors and modelopt (and, for ``--run-engine``, tensorrt_llm). Its inputs come in one JSON job
file (paths, the calibration token ids quantkit's own loader built, the quantization asked for); its progress
goes out as one JSON object per line on the original stdout, while everything the libraries print is sent to
stderr, which the parent keeps as a log.

    python quantkit/producers/trt/worker.py --config job.json          # quantize + export (step 1)
    python -m quantkit.producers.trt.worker --config job.json          # the same, with PYTHONPATH at the repo
    python quantkit/producers/trt/worker.py --run-engine --config job.json   # load an engine, generate (step 2)

Tested with nvidia-modelopt 0.47.0, torch 2.13.0 (CPU), transformers 5.14.1, safetensors 0.8.0.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

# Run by path, this file's folder would be sys.path[0] and its siblings importable as top-level modules; drop it
# so nothing here can shadow a library module.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != _HERE]

# quantkit's TrtSpec.quantization -> the ModelOpt preset that implements it.
PRESETS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "w4a16_nvfp4": "W4A16_NVFP4_CFG",
}
# The K/V projections' output quantizers ("bmm" quantizers) carry the KV-cache scales.
KV_QUANTIZERS = "*[kv]_bmm_quantizer"
# KV-cache dtypes the unified Hugging Face export can carry.
HF_KV_CACHES = ("fp8", "auto")
DISTRIBUTIONS = ("nvidia-modelopt", "torch", "transformers", "safetensors", "accelerate", "tensorrt_llm")


class Events:
    """One JSON object per line to the parent; library chatter is moved to stderr so it cannot interleave."""

    def __init__(self) -> None:
        self._out: TextIO = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def emit(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, **fields}, default=str) + "\n")
        self._out.flush()


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _device(asked: str) -> str:
    import torch

    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return asked


def _load_model(job: dict[str, Any], device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = job["dtype"]
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": bool(job.get("trust_remote_code"))}
    if device.startswith("cuda"):
        # Several visible GPUs: spread the layers over them; one GPU (or cuda:N): everything on it.
        kwargs["device_map"] = "auto" if device == "cuda" else {"": device}
    model = AutoModelForCausalLM.from_pretrained(job["model"], **kwargs)
    return model.eval()


def quant_config(quantization: str, kv_cache: str, ignore: list[str]) -> dict[str, Any] | None:
    """The ``mtq.quantize`` config: ModelOpt's preset, the KV-cache entries, then one disable per ignored module.

    ``None`` when nothing is quantized. ModelOpt's presets already keep lm_head, routers and norms in full
    precision; ``ignore`` only adds to that (a name matches the module and everything under it; wildcards pass
    through to ModelOpt's own pattern matching).
    """
    import modelopt.torch.quantization as mtq

    if quantization == "none" and kv_cache == "auto":
        return None
    if quantization == "none":
        cfg: dict[str, Any] = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, PRESETS[quantization]))
    if kv_cache == "fp8":
        cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    elif kv_cache == "int8":
        cfg["quant_cfg"].append({"quantizer_name": KV_QUANTIZERS, "cfg": {"num_bits": 8, "axis": None}})
    for name in ignore:
        cfg["quant_cfg"].append({"quantizer_name": f"*{name}.*", "enable": False})
    return cfg


def _batches(samples: list[list[int]], batch_tokens: int) -> list[list[list[int]]]:
    """Samples of equal length grouped into batches of about ``batch_tokens`` tokens (no padding needed)."""
    by_len: dict[int, list[list[int]]] = {}
    for s in samples:
        by_len.setdefault(len(s), []).append(s)
    out = []
    for length in sorted(by_len):
        group = by_len[length]
        size = max(1, batch_tokens // max(1, length))
        out += [group[i:i + size] for i in range(0, len(group), size)]
    return out


def _forward_loop(samples: list[list[int]], batch_tokens: int, device: str, events: Events) -> Callable[[Any], None]:
    """The calibration loop ModelOpt calls (once for max calibration, twice for AWQ): one progress bar per pass."""
    import torch

    batches = _batches(samples, batch_tokens)
    passes = [0]

    def loop(model: Any) -> None:
        passes[0] += 1
        target = device if not device.startswith("cuda") else next(model.parameters()).device
        events.emit("bar", key="calibrate", description=f"Calibrating (pass {passes[0]})", total=len(batches))
        with torch.no_grad():
            for batch in batches:
                model(torch.tensor(batch, dtype=torch.long, device=target))
                events.emit("advance", n=1)

    return loop


def _count_quantizers(model: Any) -> dict[str, int]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    counts = {"weight": 0, "input": 0, "kv_cache": 0}
    for name, module in model.named_modules():
        if not isinstance(module, TensorQuantizer) or not module.is_enabled:
            continue
        if name.endswith("weight_quantizer"):
            counts["weight"] += 1
        elif name.endswith("input_quantizer"):
            counts["input"] += 1
        elif name.endswith(("k_bmm_quantizer", "v_bmm_quantizer")):
            counts["kv_cache"] += 1
    return counts


def _drop_kv_quantizers(model: Any) -> None:
    from modelopt.torch.quantization.nn import TensorQuantizer

    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer) and name.endswith(("k_bmm_quantizer", "v_bmm_quantizer")):
            module.reset_amax()
            module.disable()


def quantize_and_export(job: dict[str, Any], events: Events) -> None:
    events.emit("versions", versions=_versions(), python=sys.executable)
    events.emit("step", key="import_modelopt", description="Importing torch, transformers and ModelOpt")
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    torch.manual_seed(job.get("seed", 0))
    device = _device(job.get("device", "auto"))

    events.emit("step", key="load_model", description=f"Loading the model on {device}")
    model = _load_model(job, device)
    export_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    cfg = quant_config(job["quantization"], job["kv_cache"], job.get("ignore", []))
    counts = {"weight": 0, "input": 0, "kv_cache": 0}
    if cfg is not None:
        samples = json.loads(Path(job["calibration"]).read_text())
        loop = _forward_loop(samples, int(job.get("batch_tokens", 4096)), device, events)
        model = mtq.quantize(model, cfg, loop)
        counts = _count_quantizers(model)
    events.emit("quantizers", counts=counts)

    # The TensorRT-LLM checkpoint is written first: export_hf_checkpoint folds the quantizers into the module
    # weights in place, and a TensorRT-LLM export taken afterwards would quantize those already-rounded weights a
    # second time.
    trt = job["trtllm"]
    events.emit("step", key="export_trtllm",
                description=f"Writing the TensorRT-LLM checkpoint (tp={trt['tp']}, pp={trt['pp']})")
    export_tensorrt_llm_checkpoint(model, job["decoder_type"], dtype=export_dtype, export_dir=trt["dir"],
                                   inference_tensor_parallel=trt["tp"], inference_pipeline_parallel=trt["pp"])

    events.emit("step", key="export_hf", description="Writing the unified Hugging Face checkpoint")
    hf_kv_cache = job["kv_cache"]
    if hf_kv_cache not in HF_KV_CACHES:
        # ModelOpt's unified export asserts on INT8 KV-cache scales (FP8 and NVFP4 only): this checkpoint keeps a
        # model-dtype KV cache (quantizers off, their scales dropped); the TensorRT-LLM checkpoint above already
        # has the INT8 one.
        _drop_kv_quantizers(model)
        hf_kv_cache = "auto"
    export_hf_checkpoint(model, dtype=export_dtype, export_dir=job["hf"]["dir"])
    events.emit("result", export_dtype=str(export_dtype).removeprefix("torch."), device=device, quantizers=counts,
                hf_kv_cache=hf_kv_cache)


def run_engine(job: dict[str, Any], events: Events) -> None:
    """Load a built engine with TensorRT-LLM's runtime and generate a few tokens greedily (rank 0 of 1)."""
    import torch
    from tensorrt_llm.runtime import ModelRunner

    events.emit("versions", versions=_versions(), python=sys.executable)
    events.emit("step", key="engine_run", description="Loading the engine and generating")
    runner = ModelRunner.from_dir(engine_dir=job["engine_dir"], rank=0)
    batch = [torch.tensor(ids, dtype=torch.int32) for ids in job["prompts"]]
    out = runner.generate(batch_input_ids=batch, max_new_tokens=job["max_new_tokens"], end_id=job["end_id"],
                          pad_id=job["pad_id"], temperature=1.0, top_k=1, output_sequence_lengths=True,
                          return_dict=True)
    ids, lengths = out["output_ids"], out["sequence_lengths"]
    generated = []
    for b, prompt in enumerate(job["prompts"]):
        generated.append(ids[b, 0, len(prompt):int(lengths[b, 0])].tolist())
    events.emit("result", generated=generated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="job JSON written by quantkit")
    parser.add_argument("--run-engine", action="store_true", help="load an engine and generate (step 2)")
    args = parser.parse_args(argv)
    events = Events()
    started = time.perf_counter()
    try:
        job = json.loads(args.config.read_text())
        (run_engine if args.run_engine else quantize_and_export)(job, events)
    except BaseException as e:  # the parent turns this into one readable error; the traceback goes to the log
        traceback.print_exc()
        events.emit("error", type=type(e).__name__, message=str(e) or type(e).__name__)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    events.emit("done", seconds=round(time.perf_counter() - started, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
