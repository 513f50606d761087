"""``--dry-run``: what a command would do, from headers and configs only, without loading a weight.

For each output of a recipe: the producer's own checks (group sizes, ignore patterns, supported architecture,
calibration length) and what it would choose from the source unasked (a group size other than the default),
whether it would be built, reused or refused (``quantkit run``'s reuse rule, an existing output without
``--force``), the calibration tokens it reads (or why none), the free disk space it needs while it is made
(:func:`disk_need`, what the free-space check asks for: more than the artifact's size where the producer writes an
intermediate beside it, as GGUF does), the expected peak memory, and how it would be evaluated and smoke-tested here (which engine,
reading which folder: :class:`Step`, the same decision ``quantkit run`` acts on), or why those steps would be
skipped, with the recipe's lm-eval tasks and the ones an output's engine cannot score.

Peak memory is a rule of thumb per producer family, from the checkpoint's safetensors headers (see
:func:`_memory`), meant to tell a 40 GiB job from a 400 GiB one before it starts, not to the gigabyte. Host memory
is what the process holds of its own (the source's files it maps are page cache, which the kernel takes back and
reads again as each layer is needed), and :func:`check_host_memory` refuses a job whose estimate exceeds what the
machine can hold: GPTQ of a 70B bf16 model, which rewrites every weight into its own memory, needs about 145 GB of
host memory, and on a 126 GiB host it would be killed after minutes of loading (``bench/results/h200/70b/``); FP8
static of it, which only observes the weights, about half that.
"""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit import calibration, formats, producers, source as source_mod
from quantkit.engines import registry
from quantkit.errors import HostMemoryError, OutputExistsError, UsageError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import EVALUATING, LLAMACPP, TRANSFORMERS, VLLM, KindName, Method
from quantkit.formats.specs import MethodBase, TrtSpec
from quantkit.producers.base import Producer
from quantkit.producers import mixed
from quantkit.producers.groups import Checked, input_widths, narrow_note
from quantkit.progress import fmt_bytes
from quantkit.recipe import CalibrationSpec, Recipe
from quantkit.reuse import reusable
from quantkit.source import SourceModel, safetensors_header

if TYPE_CHECKING:
    from quantkit.tasks.resolve import Task

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
    disk_bytes: int  # the free space it needs while it is made (:func:`disk_need`), not the artifact's size
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
    notes: list[str] = field(default_factory=list)  # what holds for every output (the recipe's lm-eval tasks)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "outputs": [asdict(o) for o in self.outputs], "notes": self.notes}

    def check(self) -> None:
        """Exit as the build would (2) where it would refuse an output (one that exists, without ``--force``), once
        the plan is shown: a dry run used as a pre-flight check must not pass what the run then refuses."""
        if self.refusals:
            more = f" (and {len(self.refusals) - 1} more output(s))" if len(self.refusals) > 1 else ""
            raise OutputExistsError(self.refusals[0] + more,
                                    hint="pass --force to replace it, or choose another output")


def make(recipe: Recipe, *, force: bool = False, pipeline: bool = False, evaluate: bool = True,
         smoke: bool = True, method: str | None = None, tasks: list[Task] | None = None) -> Plan:
    """The plan of a recipe's outputs (``pipeline``: as ``quantkit run`` would, with reuse, eval and smoke;
    ``tasks``: the recipe's lm-eval tasks, built and checked, which it scores on each output it evaluates)."""
    if pipeline and evaluate and recipe.evaluation.enabled:
        calibration.check_eval_field(recipe.evaluation.dataset, recipe.evaluation.field)
    src = source_mod.resolve(recipe.model)
    out = Plan(source={"id": src.spec, "path": str(src.path), "architecture": src.architecture,
                       "parameters": src.num_parameters, "size_bytes": src.size_bytes},
               notes=[tasks_line(tasks)] if tasks else [])
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
        unmade = None if action == "reuse" else spec  # what is not made yet is foreseen from its spec
        evaluates = pipeline and evaluate and recipe.evaluation.enabled
        scoring = evaluation_step(kind, path, recipe, unmade) if evaluates else None
        if scoring is not None and (note := _tasks_note(tasks or [], scoring)):
            notes.append(note)
        out.outputs.append(PlannedOutput(
            name=formats.folder(spec) if recipe.outputs else path.name, format=row.key, kind=kind.label,
            path=str(path), action=action, why=why, calibration=calib,
            disk_bytes=disk_need(prepared.producer, spec, src), host_bytes=host, gpu_bytes=gpu,
            evaluate=_evaluate(scoring, path, recipe, pipeline and evaluate),
            smoke=_smoke(kind, path, recipe, unmade, pipeline and smoke),
            notes=notes))
    return out


def disk_need(producer: Producer, spec: MethodBase, src: SourceModel) -> int:
    """The free space an output needs while it is made, which the plan shows and the free-space check asks for: the
    artifact (``estimate_bytes``) and what its producer writes beside it only while it works (``working_bytes``,
    where it has one: GGUF's 16-bit intermediate)."""
    working = getattr(producer, "working_bytes", None)
    return producer.estimate_bytes(spec, src) + (working(spec, src) if working else 0)


@dataclass(frozen=True)
class Step:
    """How ``quantkit run`` evaluates or smoke-tests one output, decided once for the run and its plan: the engine,
    the folder it reads (the kind's: :meth:`quantkit.formats.kinds.Kind.folder`, a build-trt artifact's ``hf/``),
    and why the step is skipped here (None: it runs)."""

    engine: str | None
    folder: Path
    skipped: str | None = None


def evaluation_step(kind: Kind, path: Path, recipe: Recipe, spec: MethodBase | None = None) -> Step:
    """The evaluation of the output at ``path``: in the recipe's engine, else the one ``eval --engine auto`` picks
    for the folder its kind's engines read (the kind's own while the output is not made). Skipped where that engine
    cannot read the folder (:func:`_refusal`: never a ModelOpt export through transformers, which loads it silently
    wrong), or where the engine picked for it is a GPU engine that cannot run here (vLLM not installed, no GPU: the
    reason the smoke test gives). A GPU engine the recipe names and this machine lacks is the recipe's error,
    refused before the baseline is scored. ``spec``: the output's while it is not made (a plan's output to build),
    whose evaluation is foreseen from it and its kind rather than read from the folder."""
    folder = kind.folder(path)
    chosen = recipe.evaluation.engine
    engine = chosen if chosen != "auto" else _foreseen_kind(kind, spec).evaluate if spec is not None else \
        registry.evaluating_engine(folder)
    if engine is None:
        return Step(None, folder, f"a {kind.name} artifact cannot be evaluated")
    why = _refusal(engine, folder, spec, kind)
    if why is None and chosen == "auto" and registry.get(engine).gpu:
        why = registry.engine_unavailable(engine, recipe.smoke.python)
    return Step(engine, folder, why)


def smoke_step(kind: Kind, path: Path, recipe: Recipe, spec: MethodBase | None = None) -> Step:
    """The smoke test of the output at ``path``: the recipe's engine (``smoke.engine``), else its kind's, serving
    the folder the kind's engines read; skipped where the engine cannot read it (:func:`_refusal`) or, picked
    automatically, cannot run here (not installed, no GPU). An engine the recipe names runs whatever this machine
    has, so that its absence fails the smoke test rather than passing as a skip. ``spec``: as
    :func:`evaluation_step`'s."""
    folder = kind.folder(path)
    chosen = recipe.smoke.engine
    engine = chosen if chosen != "auto" else kind.serve
    if engine is None:
        return Step(None, folder, f"no engine serves a {kind.name} artifact")
    why = _refusal(engine, folder, spec, kind)
    if why is None and chosen == "auto":
        why = registry.engine_unavailable(engine, recipe.smoke.python)
    return Step(engine, folder, why)


def _foreseen_kind(kind: Kind, spec: MethodBase) -> Kind:
    """The kind of the folder an output's engines will read, foreseen from its spec while it is not made: the kinds
    row whose engine ``eval --engine auto`` then picks for that folder (:func:`quantkit.engines.registry.
    evaluating_engine`, what the run asks of a made output), so that the plan names the engine the run uses. A
    build-trt output's hf/ is a ModelOpt export or a plain checkpoint as its export leaves it
    (:func:`quantkit.producers.trt.hf_kind`: ``none`` scores in transformers); any other output is of its own kind."""
    if not isinstance(spec, TrtSpec):
        return kind
    from quantkit.formats import kinds
    from quantkit.producers.trt import hf_kind

    return kinds.BY_NAME[hf_kind(spec)]


def _refusal(engine: str, folder: Path, spec: MethodBase | None, kind: Kind) -> str | None:
    """Why ``engine`` cannot read an output's folder at all, whatever is installed: the engine's own check of the
    folder (:func:`quantkit.engines.logits.check_compatible`: GGUF outside llama.cpp and the reverse, a ModelOpt
    export of an algorithm vLLM has no method for, a layout transformers cannot reload or would load wrong), or, for
    an output not made yet, foreseen from its kind and spec: the same kind rule
    (:func:`quantkit.engines.logits.kind_refusal`) on the kind its folder will be, then :func:`_foreseen_refusal`.
    A serving-only engine (TensorRT-LLM) refuses nothing before it starts."""
    if engine not in EVALUATING:
        return None
    from quantkit.engines import logits

    if spec is not None:
        foreseen = _foreseen_kind(kind, spec)
        refused = logits.kind_refusal(engine, foreseen.name, folder)
        return refused.message if refused else _foreseen_refusal(engine, folder, spec, foreseen)
    try:
        logits.check_compatible(engine, folder)
    except UsageError as e:
        return e.message
    return None


def _foreseen_refusal(engine: str, folder: Path, spec: MethodBase, foreseen: Kind) -> str | None:
    """What :func:`_refusal` will say of an output once it is made, from its spec and the kind of the folder it will
    leave (``foreseen``, :func:`_foreseen_kind`): vLLM refuses a build-trt export whose ModelOpt algorithm it has no
    method for (:func:`quantkit.engines.vllm.kernels.vllm_refusal`), and transformers (named by the recipe) the
    ModelOpt export hf/ will be, in the words of its own check of the folder, which the run asks of the folder it
    finds."""
    if not isinstance(spec, TrtSpec):
        return None
    if engine == TRANSFORMERS:
        from quantkit.engines.transformers import logits

        try:
            logits.refuse(folder, foreseen)
        except UsageError as e:
            return e.message
        return None
    if engine != VLLM:
        return None
    from quantkit.engines.vllm import kernels
    from quantkit.producers.trt import QUANT_ALGO

    algo = QUANT_ALGO[spec.quantization]
    if kernels.vllm_loads_modelopt(algo):
        return None
    return (f"{spec.quantization} exports ModelOpt {algo}, a TensorRT-LLM format vLLM {kernels.VLLM_VERSION} does not "
            "load; TensorRT-LLM serves it")


def unscored_tasks(tasks: list[Task], step: Step) -> tuple[list[Task], str] | None:
    """The lm-eval tasks an output's evaluation will not score, and why (None: it scores them all): every one where
    the evaluation is skipped, and on llama.cpp (a GGUF output, served by llama-server, which gives no prompt
    log-probabilities) the loglikelihood and multiple-choice ones, while its generation tasks are scored."""
    unscored = tasks if step.skipped else [t for t in tasks if step.engine == LLAMACPP and t.needs_logprobs]
    return (unscored, step.skipped or "llama-server gives no prompt log-probabilities") if unscored else None


def _tasks_note(tasks: list[Task], step: Step) -> str | None:
    """The plan's note on an output whose evaluation will leave some of the recipe's tasks unscored, and why."""
    unscored = unscored_tasks(tasks, step)
    if unscored is None:
        return None
    because = "its evaluation is skipped" if step.skipped else unscored[1]
    return f"tasks not scored: {', '.join(t.name for t in unscored[0])} ({because})"


def tasks_line(tasks: list[Task]) -> str:
    """The plan's line under the table naming the recipe's lm-eval tasks, as each is scored."""
    def one(t: Task) -> str:
        said = [t.output_type] + [f"{k} {v}" for k, v in (("limit", t.spec.limit), ("few-shot", t.spec.num_fewshot))
                                  if v is not None]
        said += [f"min_recovery {m} {x:g}" for m, x in t.gates.items()]
        return f"{t.name} ({', '.join(said)})"

    return "lm-eval tasks, scored on each output evaluated: " + "; ".join(one(t) for t in tasks)


def _evaluate(step: Step | None, path: Path, recipe: Recipe, asked: bool) -> str:
    """The plan's evaluate column: the engine, the folder it reads where not the output's, and the protocol."""
    if not asked:
        return "not part of this command"
    if step is None:
        return "skipped (evaluation.enabled is false)"
    if step.skipped:
        return _skipped(step, path)
    ev = recipe.evaluation
    return (f"{step.engine}{_reading(step, path)}, {ev.dataset}, ctx {ev.ctx}"
            + (f", at most {ev.max_tokens:,} tokens" if ev.max_tokens else ""))


def _smoke(kind: Kind, path: Path, recipe: Recipe, spec: MethodBase | None, asked: bool) -> str:
    """The plan's smoke column: the server and the folder it serves where not the output's, or why it is skipped."""
    if not asked:
        return "not part of this command"
    if not recipe.smoke.enabled:
        return "skipped (smoke.enabled is false)"
    step = smoke_step(kind, path, recipe, spec)
    return _skipped(step, path) if step.skipped else f"{step.engine} server on 127.0.0.1{_reading(step, path)}"


def _skipped(step: Step, path: Path) -> str:
    """A skipped step as the plan says it, with the engine and folder it would have read where that is a folder
    inside the output (``vllm on hf/: skipped (...)``)."""
    return (f"{step.engine}{_reading(step, path)}: " if step.folder != path else "") + f"skipped ({step.skipped})"


def _reading(step: Step, path: Path) -> str:
    """`` on hf/``: the folder a step's engine reads, where it is one inside the output."""
    return f" on {step.folder.relative_to(path).as_posix()}/" if step.folder != path else ""


@dataclass(frozen=True)
class LayerWeights:
    """The biggest decoder layer, from the headers: what llm-compressor's sequential pipeline holds on the GPU at
    once (it onloads one decoder layer, calibrates it, quantizes it, propagates, and offloads it again)."""

    total: int = 0  # bytes of the layer, every expert included
    experts: int = 0  # bytes of its routed experts (tensors under ``.experts.``)
    matrices: tuple[tuple[int, int], ...] = ()  # (out, in) of each 2-D weight: the Linears GPTQ holds a Hessian of
    model_experts: int = 0  # bytes of every layer's routed experts: what a load that stacks them holds of its own
    per_expert: bool = False  # one tensor per expert in the headers (quantkit.producers.moe.per_expert_checkpoint)


def _largest_layer(src: SourceModel) -> LayerWeights:
    """The decoder layer with the most bytes (all its experts, for a mixture of experts), from the headers; the
    whole model as one layer where no tensor is named as a layer's."""
    from quantkit.producers import moe

    layers: dict[int, list[tuple[str, list[int], int]]] = {}
    names: list[str] = []
    for f in src.weight_files:
        if f.suffix != ".safetensors":
            continue
        header, _ = safetensors_header(f)
        names += header
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
                        matrices=tuple(m for name, s, _ in tensors for m in _matrices(name, s)),
                        model_experts=sum(n for ts in layers.values() for name, _, n in ts if ".experts." in name),
                        per_expert=moe.per_expert_checkpoint(names))


def _matrices(name: str, shape: list[int]) -> list[tuple[int, int]]:
    """(out, in) of the Linears a weight becomes once the experts are linearized: a 2-D weight is one; a fused 3-D
    experts tensor (transformers 5's ``experts.gate_up_proj`` [experts, 2 x intermediate, hidden], ``down_proj``
    [experts, hidden, intermediate]) is one per expert, the gate and up projections apart."""
    if len(shape) == 2 and name.endswith(".weight"):
        return [(int(shape[0]), int(shape[1]))]
    if len(shape) == 3 and ".experts." in name:
        n, out, inp = map(int, shape)
        return [(out // 2, inp)] * (2 * n) if name.endswith("gate_up_proj") else [(out, inp)] * n
    return []


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
    """(host, GPU) peak bytes, by producer family. Host bytes are the process's own memory; the pages it maps from
    the source's files are the kernel's to take back and read again, so they are not counted (but see
    :func:`check_host_memory` for an address-space limit, which does count them).

    * llm-compressor: the model's weights the process holds of its own (:func:`_model_held`: all of them where the
      method rewrites them as it calibrates or the load converts their dtype), the calibration activations between
      layers (samples x seq_len x hidden, bf16, twice), for a mixture of experts one layer's experts copied while
      they are linearized, and the compressed copy of the quantized weights that compression builds before the
      model is saved (``quantized_bytes``, scales included). GPTQ of Qwen2.5-32B's full shape (65.5 GB model,
      15.6 GB of it quantized in the artifact) peaked at 80.9 GB of host memory in use (84.3 GB RSS), planned
      84.0 GB; FP8 static, which only observes the weights, held 30.5 GiB of its own (the FP8 copy) beside the
      source's 61 GiB of mapped pages, planned 33.2 GiB (``bench/results/h100/32b/``); FP8 static of the full
      Qwen3-30B-A3B, its experts loaded per expert, 30.2 GiB in use, planned 32.3 GiB
      (``bench/results/h100/30b-a3b/``). The GPU holds one layer at a time: the fit above. No GPU: the layer's
      work (activations of a few samples, GPTQ's Hessians) on the host instead.
    * GGUF: streams one tensor chunk at a time; llama.cpp's quantizer holds one tensor in float32 and its output.
    * ModelOpt: the whole model on the device it runs on.

    A job for a GPU can be planned on a machine without one: ``--device cuda`` gives the GPU estimate anyway.
    """
    cfg = src.config.get("text_config") or src.config
    hidden = int(cfg.get("hidden_size") or 0)
    model = _model_bytes(recipe, src)
    if row.kind == KindName.GGUF:
        return (64 << 20) + layer.total * 2, 0
    device = recipe.runtime.device
    on_gpu = device.startswith("cuda") or (device == "auto" and _cuda())
    if row.kind == KindName.TENSORRT_LLM:
        return model, model if on_gpu else 0
    c = recipe.calibration
    tokens = c.samples * c.seq_len if row.calibrates(spec) else 0
    acts = tokens * hidden * 2 * 2
    from quantkit.producers.compressed import PRODUCER as COMPRESSED

    host = _model_held(spec, recipe, src, layer) + acts + layer.experts + COMPRESSED.quantized_bytes(spec, src)
    gptq = _gptq_bytes(layer) if Method.GPTQ in (spec.method, getattr(spec, "weights", None)) else 0
    if not on_gpu:
        return host + acts // max(c.samples, 1) * 8 + gptq, 0
    awq = tokens * hidden * _AWQ_BYTES_PER_TOKEN_AND_HIDDEN if spec.method == Method.AWQ else 0
    if getattr(spec, "offload_activations", False):
        awq = int(awq * _AWQ_OFFLOADED_SHARE)
    work = _GPU_DENSE_COPIES * (layer.total - layer.experts) + _GPU_EXPERT_COPIES * layer.experts
    return host, _GPU_FIXED + work + gptq + awq


def rewrites_weights(spec: MethodBase) -> bool:
    """Whether making ``spec`` rewrites the model's weights into the process's own memory while it calibrates
    (llm-compressor's GPTQ, AWQ, SmoothQuant, AutoRound: :attr:`quantkit.producers.modifiers.Plan.rewrites_weights`).
    Where they are only observed (FP8, FP4, RTN) the model stays in the pages the load mapped from the source's
    files, which the kernel can take back."""
    from quantkit.producers import modifiers

    return formats.for_spec(spec).llmcompressor and modifiers.plan(spec).rewrites_weights


def _model_bytes(recipe: Recipe, src: SourceModel) -> int:
    """The loaded model's bytes: the checkpoint's own where it loads in its dtype, else its parameters at the
    recipe's dtype."""
    if recipe.model.dtype == "auto":
        return src.size_bytes
    return src.num_parameters * (4 if recipe.model.dtype == "float32" else 2)


def _model_held(spec: MethodBase, recipe: Recipe, src: SourceModel, layer: LayerWeights) -> int:
    """The bytes of the loaded model that are the process's own memory rather than the source's mapped pages: all of
    them where the method rewrites the weights (:func:`rewrites_weights`) or the load converts their dtype; for a
    mixture of experts whose load stacks the experts into 3-D tensors (a fused checkpoint, another transformers:
    :func:`quantkit.producers.moe.loads_per_expert`), its experts; none otherwise (FP8 static of the 32B: 30.5 GiB
    of the process's own, the FP8 copy, beside 61 GiB of the source mapped)."""
    from quantkit.producers import moe

    if rewrites_weights(spec) or recipe.model.dtype != "auto":
        return _model_bytes(recipe, src)
    if not layer.model_experts or moe.loads_per_expert(src.config, layer.per_expert, recipe.model.trust_remote_code):
        return 0
    return layer.model_experts


def memory(recipe: Recipe, spec: MethodBase, src: SourceModel) -> tuple[int, int]:
    """(host, GPU) peak bytes of one output, the floor that ``--dry-run`` shows."""
    return _memory(formats.for_spec(spec), spec, recipe, src, _largest_layer(src))


_ADDRESS_SPACE = "the process's address-space limit (ulimit -v)"


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
        limit = (address_space, _ADDRESS_SPACE)
    return limit if limit[0] > 0 else None


def check_host_memory(recipe: Recipe, spec: MethodBase, src: SourceModel) -> None:
    """Refuse, before any weight is loaded, an output whose host-memory floor exceeds what this machine holds.

    Not for ``--num-gpus`` 2 or more: that path loads through compressed-tensors' ``auto_offload``, which keeps on
    the host what fits and spills the rest to disk."""
    limit = host_limit()
    llmcompressor = formats.for_spec(spec).llmcompressor
    if limit is None or (llmcompressor and recipe.runtime.num_gpus > 1):
        return
    layer = _largest_layer(src)
    host, _ = _memory(formats.for_spec(spec), spec, recipe, src, layer)
    what = "the whole model is held there"
    if llmcompressor:
        from quantkit.producers.compressed import PRODUCER as COMPRESSED

        held = _model_held(spec, recipe, src, layer)
        what = ", ".join(part for part in (
            f"{fmt_bytes(held)} of the model's weights as its own" if held else "",
            f"a {fmt_bytes(COMPRESSED.quantized_bytes(spec, src))} compressed copy",
            "the activations and one layer's work") if part)
        if limit[1] == _ADDRESS_SPACE and recipe.model.dtype == "auto" and src.size_bytes > held:
            # the source's pages the process maps take address space, whatever the kernel does with them
            host += src.size_bytes - held
            what += f", and {fmt_bytes(src.size_bytes - held)} of the source's files mapped"
    if host > limit[0]:
        spill = (", or --num-gpus 2 or more (loads through llm-compressor's offload, which spills to disk)"
                 if llmcompressor else "")
        raise HostMemoryError(
            f"{src.spec} needs at least {fmt_bytes(host)} of host memory for {spec.method} ({what}), and {limit[1]} "
            f"allow {fmt_bytes(limit[0])}",
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
