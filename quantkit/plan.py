"""``--dry-run``: what a command would do, from headers and configs only, without loading a weight.

For each output of a recipe: the producer's own checks (group sizes, ignore patterns, supported architecture,
calibration length) and what it would choose from the source unasked (a group size other than the default),
whether it would be built, reused or refused (``quantkit run``'s reuse rule, an existing output without
``--force``), the calibration tokens it reads (or why none), the expected size on disk (the
producer's estimate, the same one the free-space check uses), the expected peak memory, and how it would be
evaluated and smoke-tested here, or why those steps would be skipped.

Peak memory is a rule of thumb per producer family, from the checkpoint's safetensors headers (see
:func:`_memory`), meant to tell a 40 GiB job from a 400 GiB one before it starts, not to the gigabyte. It is a
floor (measured peaks are higher), so :func:`check_host_memory` refuses a job whose floor exceeds what the machine
can hold: a 70B bf16 model needs about 145 GB of host memory, and on a 126 GiB host it would be killed after minutes
of loading (``bench/results/h200/70b/``).
"""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit import calibration, formats, producers, source as source_mod
from quantkit.engines.registry import engine_unavailable
from quantkit.errors import HostMemoryError, OutputExistsError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import KindName, Method
from quantkit.formats.specs import MethodBase
from quantkit.producers.base import Producer
from quantkit.producers import mixed
from quantkit.producers.groups import Checked, input_widths, narrow_note
from quantkit.progress import fmt_bytes
from quantkit.recipe import CalibrationSpec, Recipe
from quantkit.reuse import reusable
from quantkit.source import SourceModel, safetensors_header

_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")


@dataclass
class PlannedOutput:
    """One output as it would be made."""

    name: str
    format: str  # registry row (method, and layout when not the default)
    kind: str
    path: str
    action: str  # build | reuse | refuse
    why: str
    calibration: str
    disk_bytes: int
    host_bytes: int
    gpu_bytes: int
    evaluate: str
    smoke: str
    notes: list[str] = field(default_factory=list)  # what the producer decides from the source, unasked


@dataclass(frozen=True)
class Prepared:
    """One output checked before anything loads: its registry row, its producer, what the producer's check decided
    from the source (its group choice, for llm-compressor's methods), whether it reads calibration data and what
    the calibration check found, and the warnings to say before it is made."""

    row: formats.Format
    producer: Producer
    checked: Any
    calibrates: bool
    calibration: str | None = None  # calibration.check's few words, when the output calibrates
    reads: CalibrationSpec | None = None  # the calibration it reads (:func:`calibration_read`), when it calibrates
    warnings: tuple[str, ...] = ()


def prepare(recipe: Recipe, spec: MethodBase, src: SourceModel) -> Prepared:
    """The checks every output passes before anything loads, the same for a build (:func:`quantkit.api.quantize_one`,
    which carries ``checked`` to the producer and says the warnings) and for ``--dry-run`` (:func:`make`): the
    producer's own, then the calibration's (:func:`quantkit.calibration.check`: the documents read and tokenized, so
    the dry run refuses what the build would)."""
    row = formats.for_spec(spec)
    producer = producers.get(spec)
    checked = producer.check(spec, src)
    calibrates = row.calibrates(spec)
    if calibrates:
        reads = calibration_read(row, spec, recipe.calibration)
        found = calibration.check(reads, src, trust_remote_code=recipe.model.trust_remote_code)
        return Prepared(row, producer, checked, calibrates, calibration=found, reads=reads)
    return Prepared(row, producer, checked, calibrates, warnings=_unused_calibration(recipe, row))


def calibration_read(row: formats.Format, spec: MethodBase, settings: CalibrationSpec) -> CalibrationSpec:
    """The calibration an output reads: the recipe's, narrowed by llm-compressor's producer where only a bits
    target's sensitivity pass reads data (:func:`quantkit.producers.compressed.calibration_read`)."""
    if not row.llmcompressor:
        return settings
    from quantkit.producers.compressed import calibration_read as read

    return read(spec, settings)


def _unused_calibration(recipe: Recipe, row: formats.Format) -> tuple[str, ...]:
    """A warning for calibration settings given where nothing reads them (``fp8 --scheme dynamic --calib x``): said,
    not refused, as a setting of no effect. Not for an output of a recipe where another output reads them."""
    given = [flag.flag for flag in formats.CALIBRATION
             if flag.field.partition(".")[2] in recipe.calibration.model_fields_set]
    if not given or any(formats.calibrates(s) for s, _ in recipe.artifacts()):
        return ()
    return (f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not used: {row.key} reads no calibration data "
            "with these settings",)


@dataclass
class Plan:
    """Everything ``--dry-run`` prints, as data."""

    source: dict[str, Any]
    outputs: list[PlannedOutput] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # what the build would refuse with, one line per output

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "outputs": [asdict(o) for o in self.outputs]}

    def check(self) -> None:
        """Exit as the build would (2) where it would refuse an output (one that exists, without ``--force``), once
        the plan is shown: a dry run used as a pre-flight check must not pass what the run then refuses."""
        if self.refusals:
            more = f" (and {len(self.refusals) - 1} more output(s))" if len(self.refusals) > 1 else ""
            raise OutputExistsError(self.refusals[0] + more,
                                    hint="pass --force to replace it, or choose another output")


def make(recipe: Recipe, *, force: bool = False, pipeline: bool = False, evaluate: bool = True,
         smoke: bool = True, method: str | None = None) -> Plan:
    """The plan of a recipe's outputs (``pipeline``: as ``quantkit run`` would, with reuse, eval and smoke)."""
    src = source_mod.resolve(recipe.model)
    out = Plan(source={"id": src.spec, "path": str(src.path), "architecture": src.architecture,
                       "parameters": src.num_parameters, "size_bytes": src.size_bytes})
    layer = _largest_layer(src)
    for spec, path in recipe.artifacts():
        if method is not None and spec.method != method:
            continue
        prepared = prepare(recipe, spec, src)
        row = prepared.row
        action, why = "build", "not there yet"
        if path.exists():
            ok, reason = reusable(recipe, spec, path, src) if pipeline else (False, "")
            if ok and not force:
                action, why = "reuse", reason
            elif force:
                action, why = "build", "--force: replaced once the new one is complete"
            else:
                action, why = "refuse", (f"exists and cannot be reused: {reason}" if pipeline else "exists") \
                    + " (pass --force)"
                out.refusals.append(f"{path} exists but cannot be reused: {reason}" if pipeline
                                    else f"output {path} already exists")
        c = prepared.reads
        calib = (f"{c.dataset}: {c.samples} x {c.seq_len} tokens, seed {recipe.runtime.seed} ({prepared.calibration})"
                 if c is not None else f"none ({row.key} reads no calibration data)")
        host, gpu = _memory(row, spec, recipe, src, layer)
        kind = formats.kind(row.kind)
        checked = prepared.checked if isinstance(prepared.checked, Checked) else Checked(None)
        choice = checked.choice
        notes = ([choice.reason] if choice is not None and choice.changed else []) + list(prepared.warnings)
        if checked.narrow:  # FP4's layers kept for their width: the warning the run gives
            notes.append(narrow_note(spec, checked.narrow))
        if row.llmcompressor and getattr(spec, "target_bits", None) is not None:  # the bits target's plan
            notes.append(mixed.describe(choice.apply(spec) if choice else spec,
                                        list(input_widths(src.config).values())))
        out.outputs.append(PlannedOutput(
            name=formats.folder(spec) if recipe.outputs else path.name, format=row.key, kind=kind.label,
            path=str(path), action=action, why=why, calibration=calib,
            disk_bytes=prepared.producer.estimate_bytes(spec, src), host_bytes=host, gpu_bytes=gpu,
            evaluate=_evaluate(kind, recipe, pipeline and evaluate),
            smoke=_smoke(kind, recipe, pipeline and smoke),
            notes=notes))
    return out


def _evaluate(kind: Kind, recipe: Recipe, asked: bool) -> str:
    if not asked:
        return "not part of this command"
    if not recipe.evaluation.enabled:
        return "skipped (verify.enabled is false)"
    if kind.evaluate is None:
        return f"skipped (a {kind.name} artifact cannot be evaluated as it is)"
    return f"{kind.evaluate}, {recipe.evaluation.dataset}, ctx {recipe.evaluation.ctx}"


def _smoke(kind: Kind, recipe: Recipe, asked: bool) -> str:
    if not asked:
        return "not part of this command"
    if not recipe.smoke.enabled:
        return "skipped (smoke.enabled is false)"
    if kind.serve is None:
        return f"skipped (no engine serves a {kind.name} artifact as it is)"
    why = engine_unavailable(kind.serve, recipe.smoke.python)
    return f"skipped ({why})" if why else f"{kind.serve} server on 127.0.0.1"


@dataclass(frozen=True)
class LayerWeights:
    """The biggest decoder layer, from the headers: what llm-compressor's sequential pipeline holds on the GPU at
    once (it onloads one decoder layer, calibrates it, quantizes it, propagates, and offloads it again)."""

    total: int = 0  # bytes of the layer, every expert included
    experts: int = 0  # bytes of its routed experts (tensors under ``.experts.``)
    matrices: tuple[tuple[int, int], ...] = ()  # (out, in) of each 2-D weight: the Linears GPTQ holds a Hessian of


def _largest_layer(src: SourceModel) -> LayerWeights:
    """The decoder layer with the most bytes (all its experts, for a mixture of experts), from the headers; the
    whole model as one layer where no tensor is named as a layer's."""
    layers: dict[int, list[tuple[str, list[int], int]]] = {}
    for f in src.weight_files:
        if f.suffix != ".safetensors":
            continue
        header, _ = safetensors_header(f)
        for name, info in header.items():
            m = _LAYER.match(name)
            if m and isinstance(info, dict):
                start, stop = info["data_offsets"]
                layers.setdefault(int(m.group(1)), []).append((name, info.get("shape") or [], stop - start))
    if not layers:
        return LayerWeights(total=src.size_bytes)
    tensors = max(layers.values(), key=lambda ts: sum(n for _, _, n in ts))
    return LayerWeights(total=sum(n for _, _, n in tensors),
                        experts=sum(n for name, _, n in tensors if ".experts." in name),
                        matrices=tuple((int(s[0]), int(s[1])) for name, s, _ in tensors
                                       if len(s) == 2 and name.endswith(".weight")))


# GPU memory of llm-compressor 0.14's sequential pipeline: a fixed part (CUDA context, allocator, embeddings) and the
# layer in work, its dense weights about five times over (the onloaded copy, fake-quantized copies, the activations
# of its big modules) and an MoE layer's experts twice (hundreds of small modules, whose temporaries are small).
# GPTQ adds what it holds when the layer ends (:func:`_gptq_bytes`). AWQ keeps every calibration token's layer inputs
# and outputs on the GPU for its grid search, about 46 bytes per token per hidden unit, 79% of that when offloaded.
# Against nvidia-smi peaks on an H200 (bench/results/h200/, 32 x 2048 tokens): the 8B shape 4.36 GiB FP8 static
# (measured 4.75), 7.47 GiB GPTQ (7.42), the 70B width 22.7 GiB GPTQ (22.63); Qwen3-30B-A3B's width with 12 layers
# 4.76 GiB FP8 static (4.66), 20.1 GiB GPTQ (21.68); AWQ as fitted on the 8B and 70B shapes.
_GPU_FIXED = 2_500_000_000
_GPU_DENSE_COPIES = 5
_GPU_EXPERT_COPIES = 2
_GPTQ_BLOCK = 128  # llm-compressor's GPTQ block size (its default; quantkit keeps it)
_AWQ_BYTES_PER_TOKEN_AND_HIDDEN = 46
_AWQ_OFFLOADED_SHARE = 0.79


def _gptq_bytes(layer: LayerWeights) -> int:
    """What llm-compressor 0.14's GPTQ holds at the end of a layer: a float32 Hessian (in x in) of every Linear, all
    accumulated before any is solved, then the largest batched solve. ``batched_quantization="auto"`` solves every
    Linear of one weight shape together (all 256 gate and up projections of a Qwen3-30B-A3B layer), each taking the
    larger of its quantization and activation-ordering peaks (``gptq/helpers.py: max_batch_size``), the Hessians
    among them counted once. Where the GPU has less free than that, llm-compressor makes the batches smaller
    (75% of free memory), so this part shrinks on a smaller GPU instead of running out."""
    hessians = sum(4 * i * i for _, i in layer.matrices)
    groups: dict[tuple[int, int], int] = {}
    for shape in layer.matrices:
        groups[shape] = groups.get(shape, 0) + 1
    solve = max((n * 4 * (max(i * i + 3 * o * i + 4 * o * _GPTQ_BLOCK, 3 * i * i + 2 * o * i) - i * i)
                 for (o, i), n in groups.items()), default=0)
    return hessians + solve


def _memory(row: formats.Format, spec: MethodBase, recipe: Recipe, src: SourceModel,
            layer: LayerWeights) -> tuple[int, int]:
    """(host, GPU) peak bytes, by producer family.

    * llm-compressor: the whole model sits on the host in its load dtype, plus the calibration activations between
      layers (samples x seq_len x hidden, bf16, twice) and, for a mixture of experts, one layer's experts copied while
      they are linearized: a floor. The GPU holds one layer at a time: the fit above. No GPU: the layer's work
      (activations of a few samples, GPTQ's Hessians) on the host instead.
    * GGUF: streams one tensor chunk at a time; llama.cpp's quantizer holds one tensor in float32 and its output.
    * ModelOpt: the whole model on the device it runs on.

    A job for a GPU can be planned on a machine without one: ``--device cuda`` gives the GPU estimate anyway.
    """
    cfg = src.config.get("text_config") or src.config
    hidden = int(cfg.get("hidden_size") or 0)
    model = src.size_bytes if recipe.model.dtype == "auto" else src.num_parameters * (
        4 if recipe.model.dtype == "float32" else 2)
    if row.kind == KindName.GGUF:
        return (64 << 20) + layer.total * 2, 0
    device = recipe.runtime.device
    on_gpu = device.startswith("cuda") or (device == "auto" and _cuda())
    if row.kind == KindName.TENSORRT_LLM:
        return model, model if on_gpu else 0
    c = recipe.calibration
    tokens = c.samples * c.seq_len if row.calibrates(spec) else 0
    acts = tokens * hidden * 2 * 2
    host = model + acts + layer.experts
    gptq = _gptq_bytes(layer) if Method.GPTQ in (spec.method, getattr(spec, "weights", None)) else 0
    if not on_gpu:
        return host + acts // max(c.samples, 1) * 8 + gptq, 0
    awq = tokens * hidden * _AWQ_BYTES_PER_TOKEN_AND_HIDDEN if spec.method == Method.AWQ else 0
    if getattr(spec, "offload_activations", False):
        awq = int(awq * _AWQ_OFFLOADED_SHARE)
    work = _GPU_DENSE_COPIES * (layer.total - layer.experts) + _GPU_EXPERT_COPIES * layer.experts
    return host, _GPU_FIXED + work + gptq + awq


def memory(recipe: Recipe, spec: MethodBase, src: SourceModel) -> tuple[int, int]:
    """(host, GPU) peak bytes of one output, the floor that ``--dry-run`` shows."""
    return _memory(formats.for_spec(spec), spec, recipe, src, _largest_layer(src))


def host_limit() -> tuple[int, str] | None:
    """How much memory this process can have, and where that limit comes from: RAM plus swap, or the cgroup v2
    limit of the container it runs in, or its address-space limit (``ulimit -v``), whichever is lowest; None where
    none can be read (not Linux). A model the address space cannot map cannot be loaded whatever the RAM."""
    try:
        info = {k: int(v.split()[0]) * 1024 for k, v in
                (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines() if ":" in ln)}
    except (OSError, ValueError, IndexError):
        return None
    limit = (info.get("MemTotal", 0) + info.get("SwapTotal", 0), "RAM and swap")
    try:
        cg = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        cg = "max"
    if cg.isdigit() and int(cg) < limit[0]:
        limit = (int(cg), "the container's memory limit")
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY and address_space < limit[0]:
        limit = (address_space, "the process's address-space limit (ulimit -v)")
    return limit if limit[0] > 0 else None


def check_host_memory(recipe: Recipe, spec: MethodBase, src: SourceModel) -> None:
    """Refuse, before any weight is loaded, an output whose host-memory floor exceeds what this machine holds.

    Not for ``--num-gpus`` 2 or more: that path loads through compressed-tensors' ``auto_offload``, which keeps on
    the host what fits and spills the rest to disk."""
    limit = host_limit()
    llmcompressor = formats.for_spec(spec).llmcompressor
    if limit is None or (llmcompressor and recipe.runtime.num_gpus > 1):
        return
    host, _ = memory(recipe, spec, src)
    if host > limit[0]:
        spill = (", or --num-gpus 2 or more (loads through llm-compressor's offload, which spills to disk)"
                 if llmcompressor else "")
        raise HostMemoryError(
            f"{src.spec} needs at least {fmt_bytes(host)} of host memory for {spec.method} (the whole model is held "
            f"there while one layer at a time is quantized), and {limit[1]} allow {fmt_bytes(limit[0])}",
            hint=f"run on a machine with more memory, or add swap{spill}; `--dry-run` shows the estimate")


def _cuda() -> bool:
    """Whether a CUDA GPU is visible (the work runs on the host otherwise). On Linux without the NVIDIA driver's
    control device no GPU can be: the answer then costs no torch import (seconds, the most of a ``--dry-run``)."""
    if sys.platform.startswith("linux") and not Path("/dev/nvidiactl").exists():
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
