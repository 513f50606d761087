"""``quantkit tune``: which of vLLM's kernels serves an artifact fastest, measured, and the command that uses it.

vLLM picks one linear kernel (and one MoE backend) per scheme by a fixed priority, and that pick is not always
the fastest for a given model and GPU: on an H200 an 8B W4A16 checkpoint decoded at 263 tok/s with vLLM's default
Machete kernel and 303 tok/s with Marlin. ``tune`` starts vLLM once per kernel configuration vLLM can use for the
artifact (:mod:`quantkit.engines.vllm.kernels` lists them and how each is forced;
:mod:`quantkit.engines.vllm.kernel_sweep` runs them), measures time to first token and decode tokens/s at each batch size, keeps only runs whose log shows the
kernel that was asked for, and chooses the fastest at batch 1: another kernel must beat the default there by 3% and
be no more than 5% slower than it at every other batch measured (on the same H200, Exllama decoded that 8B
checkpoint at 322 tok/s at batch 1 and at half Machete's speed at batch 16).

The table, the choice and the ``vllm serve`` command (flags and environment) go into the manifest's ``serving``
section (a build-trt artifact's own for its ``hf/``, as ``eval`` and ``smoke`` of it record there); the model card
written by ``quantkit run`` shows them. Needs a CUDA GPU and vLLM (its own Python: ``--python`` or
``QUANTKIT_VLLM_PYTHON``); written for vLLM 0.26.0 on Hopper.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit import envs, integrity
from quantkit.engines import registry
from quantkit.engines.vllm import kernels
from quantkit.errors import BackendError, MissingEngineError, UsageError
from quantkit.formats import kinds
from quantkit.formats.names import VLLM, KindName
from quantkit.manifest import now_iso
from quantkit.progress import Reporter


@dataclass
class TuneOptions:
    """How to measure (the flags of ``quantkit tune``)."""

    python: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    batches: tuple[int, ...] = (1, 16)
    prompt_len: int = 512
    gen: int = 128
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.85
    only: list[str] = field(default_factory=list)
    timeout: float = 600.0
    budget: float | None = None  # seconds for the whole sweep; configurations past it are "not run"
    log_dir: Path | None = None


def run(path: Path, opts: TuneOptions, reporter: Reporter | None = None) -> Any:
    """Sweep ``path``'s kernels in vLLM and record the result in the manifest of the artifact it is or belongs to
    (:func:`save`); returns the :class:`~quantkit.engines.vllm.kernel_sweep.SweepResult`."""
    from quantkit.engines.vllm import kernel_sweep

    rep = reporter or Reporter(quiet=True)
    path = Path(path)
    kind = kinds.detect(path)
    if kind.reads:  # a build-trt artifact: vLLM serves its hf/, as eval and smoke are told (registry.serving_engine)
        raise UsageError(f"{path} holds {kind.label}; vLLM serves its {kind.reads}/ folder, which is what to measure",
                         hint=f"measure its {kind.reads}/ folder: quantkit tune {kind.folder(path)}")
    if kind.serve != VLLM and kind.name != KindName.MODELOPT:
        raise UsageError(f"quantkit tune measures vLLM's kernels; {path} holds {kind.label}, which vLLM does not "
                         "serve here",
                         hint="for GGUF, llama.cpp has one kernel per type: compare types with quantkit eval")
    if why := kernels.vllm_refusal(path):
        raise UsageError(why, hint="TensorRT-LLM picks its own kernels when it builds the engine")
    row = registry.get(VLLM)
    choice = row.find_python(opts.python)
    if choice.fallback and not envs.importable_here(row.module):
        raise MissingEngineError("quantkit tune needs vLLM, which is not installed in this environment",
                         hint="pass --python /path/to/vllm-env/bin/python (or set QUANTKIT_VLLM_PYTHON)")
    bench = kernel_sweep.Bench(batches=tuple(opts.batches), prompt_len=opts.prompt_len, gen=opts.gen,
                               max_model_len=opts.max_model_len, gpu_memory_utilization=opts.gpu_memory_utilization,
                               engine_args={"quantization": "modelopt"} if kind.name == KindName.MODELOPT else {})
    runtime = kernel_sweep.Runtime(choice.python, {"VLLM_USE_FLASHINFER_SAMPLER": "0", **opts.env})
    log_dir = opts.log_dir or log_folder(path)
    deadline = time.monotonic() + opts.budget if opts.budget else None
    with rep.bar(f"Measuring vLLM's kernels for {path.name}", total=None) as bar:
        result = kernel_sweep.sweep(path, bench, runtime, log_dir, timeout=opts.timeout, deadline=deadline,
                                    only=opts.only or None,
                                    on_update=lambda r: bar.update(description=f"{len(r.measurements)} "
                                                                               f"configuration(s) measured"))
    if not any(m.status == "ok" for m in result.measurements):
        errors = "; ".join(f"{m.configuration.name}: {m.error}" for m in result.measurements)
        raise BackendError(f"vLLM ran none of the kernel configurations for {path}: {errors}",
                           hint=f"the logs are in {log_dir}")
    save(path, result)
    return result


def log_folder(path: Path) -> Path:
    """Where a sweep of ``path`` keeps its logs unless told: beside the artifact it is or belongs to (a build-trt
    artifact's, for its hf/), or beside the release that holds it, never inside either, where they would be files
    its seal does not list (:func:`quantkit.integrity.beside`)."""
    return integrity.beside(integrity.artifact_of(path) or path, "tune-logs")


def save(path: Path, result: Any) -> Path | None:
    """Record a sweep of ``path`` (:func:`record`) in the manifest of the artifact it is or belongs to: a build-trt
    artifact's own ``quantkit.json`` for its hf/, as ``eval`` and ``smoke`` of hf/ record there, so ``quantkit run``'s
    model card shows it. Returns that artifact's folder, or None where ``path`` is in no quantkit artifact (nothing
    recorded)."""
    root = integrity.artifact_of(path)
    if root is not None:
        integrity.update_manifest(root, serving=record(result))
    return root


def record(result: Any) -> dict[str, Any]:
    """The manifest's ``serving`` section for a sweep: its JSON, when, and the table as the model card shows it."""
    return {**result.to_json(), "updated": now_iso(), "table": result.markdown()}


def card_section(serving: dict[str, Any] | None) -> list[str]:
    """Model-card lines for a recorded sweep: the command to serve the artifact fastest, then the table."""
    if not serving or not serving.get("command"):
        return []
    return ["", "## Serving in vLLM", "", "Fastest configuration measured by `quantkit tune` "
            f"({(serving.get('choice') or {}).get('reason', '')}):", "", "```bash",
            serving["command"]["shell"], "```", "", serving.get("table", "").rstrip()]
