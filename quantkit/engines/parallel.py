"""Tensor parallelism for serving: whether an artifact can be split over ``tp`` GPUs, checked before a server starts.

vLLM splits each attention block by heads (column-parallel q/k/v, row-parallel o_proj) and each MLP by its
intermediate size (column-parallel gate/up, row-parallel down), so every split must fall on a whole head and on a
whole quantization group or block: a W4A16 artifact with group 128 cannot be served with tp=2 when
``intermediate_size / 2`` is not a multiple of 128, and vLLM says so only after a minute of loading, in a stack
trace. These checks say it in one line, before any process starts, and name the largest tp that works (any number
of GPUs, not only powers of two: SmolLM2-135M's 9 heads split over 3 GPUs, never 2). Key-value heads may be fewer
than tp (vLLM replicates them), but tp must then be a multiple of their number.

What each split must hold, after vLLM 0.26's checks (``MarlinLinearKernel.can_implement``: a group may not straddle
two GPUs; ``fp8_utils.validate_fp8_block_shape``: every per-GPU input and output of a block-quantized layer is
whole blocks):

* groups run along a layer's input, so the row-parallel inputs per GPU (o_proj's ``heads / tp x head_dim``,
  down_proj's ``intermediate_size / tp``) are whole groups;
* 128x128 blocks also split along the outputs: the q/k/v outputs per GPU (k and v: at least one head each, as
  vLLM replicates them) are whole blocks too, and gate/up's are the intermediate size above.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from quantkit.engines.serving import Server
from quantkit.errors import UsageError
from quantkit.checkpoint import quantization_config, read_config


def visible_gpus() -> int | None:
    """CUDA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` honoured), from ``nvidia-smi -L``; None when no
    driver tool is there to ask (then the engine finds out itself)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return 0
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def _granules(cfg: dict[str, Any]) -> list[tuple[str, int]]:
    """The units a weight split must not cut: quantization groups (along the input dimension) and FP8 blocks."""
    q = quantization_config(cfg)
    out: list[tuple[str, int]] = []
    for group in (q.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w.get("group_size"):
            out.append((f"quantization group {w['group_size']}", int(w["group_size"])))
        for n in w.get("block_structure") or []:
            out.append((f"weight block {n}", int(n)))
    if q.get("group_size") and int(q["group_size"]) > 0:  # AutoAWQ / GPTQ layouts
        out.append((f"quantization group {q['group_size']}", int(q["group_size"])))
    for n in q.get("weight_block_size") or []:
        out.append((f"weight block {n}", int(n)))
    return list(dict.fromkeys(out))


def problems(folder: Path, tp: int) -> list[str]:
    """Why ``folder`` cannot be split over ``tp`` GPUs (empty when it can, or when its config says too little)."""
    if tp == 1:
        return []
    top = read_config(folder)
    cfg = top.get("text_config") or top  # the language model's shapes; quantization_config stays at the top
    bad: list[str] = []
    heads = int(cfg.get("num_attention_heads") or 0)
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    if heads and heads % tp:
        bad.append(f"{heads} attention heads are not divisible by {tp}")
    if kv and kv % tp and tp % kv:
        bad.append(f"{kv} key-value heads: {tp} is neither a divisor nor a multiple of it")
    granules = _granules(top)
    if heads and not heads % tp and head_dim:
        per_gpu = heads // tp * head_dim
        bad += [f"{heads} heads / {tp} x head_dim {head_dim} = {per_gpu} (o_proj input per GPU) is not a multiple of "
                f"the {what}" for what, n in granules if per_gpu % n]
        kv_per_gpu = max(kv // tp, 1) * head_dim
        bad += [f"{kv} key-value heads / {tp} x head_dim {head_dim} = {kv_per_gpu} (k and v outputs per GPU) is not a "
                f"multiple of the {what}" for what, n in granules if what.startswith("weight block") and kv_per_gpu % n]
    sizes = [(k, int(cfg[k])) for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
             if cfg.get(k)]
    for name, size in sizes:
        if size % tp:
            bad.append(f"{name} {size} is not divisible by {tp}")
            continue
        for what, n in granules:
            if (size // tp) % n:
                bad.append(f"{name} / {tp} = {size // tp} is not a multiple of the {what}")
    return bad


def largest_tp(folder: Path, limit: int = 8) -> int:
    """The largest number of GPUs up to ``limit`` that ``folder`` can be split over."""
    return max(tp for tp in range(1, limit + 1) if not problems(folder, tp))


def check(folder: Path, engine: Server, tp: int) -> None:
    """Refuse (exit 2) a tensor-parallel size that the engine, the GPUs or the artifact's shapes cannot honour."""
    if tp < 1:
        raise UsageError(f"--tp {tp}: must be 1 or more")
    if tp == 1:
        return
    if engine.no_tensor_parallel:
        raise UsageError(f"--tp {tp}: {engine.name}'s server has no tensor parallelism of this kind",
                         hint=engine.no_tensor_parallel)
    gpus = visible_gpus()
    if gpus is not None and gpus < tp:
        raise UsageError(f"--tp {tp}: only {gpus} GPU(s) visible here",
                         hint="set CUDA_VISIBLE_DEVICES to at least that many GPUs, or lower --tp")
    target = folder if folder.is_dir() else folder.parent
    bad = problems(target, tp)
    if bad:
        raise UsageError(f"--tp {tp}: {target} cannot be split over {tp} GPUs: " + "; ".join(bad),
                         hint=f"the largest tensor-parallel size it allows is {largest_tp(target, max(tp, 8))}")
