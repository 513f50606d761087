"""The public Python API: one artifact at a time, what the CLI, recipes, the pipeline and the tests all call.

    from quantkit import api
    r = api.load_recipe("recipes/awq.yaml", {"model.source": "models/quantkit-tiny", "output": "out/awq"})
    result = api.quantize(r)[0]         # -> ArtifactResult, with the manifest as written

The whole pipeline of a recipe (``quantkit run``: every output, evaluated, smoke-tested, bundled) stands above these
functions and calls them: :func:`quantkit.pipeline.run`.

Each function takes plain values and returns plain results (dataclasses, the typed :class:`Manifest`); printing
is the CLI's job. Heavy libraries are imported by the modules these functions call, only when they run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from quantkit import artifact, calibration, integrity, outputs, plan as plan_mod, recipe as recipe_mod, \
    source as source_mod, versions
from quantkit.errors import RecipeError
from quantkit.formats.names import Method
from quantkit.manifest import MANIFEST, Manifest, size_bytes
from quantkit.producers.base import ProduceContext
from quantkit.progress import Reporter, fmt_bytes, fmt_num
from quantkit.recipe import NO_PROGRESS, Recipe

if TYPE_CHECKING:  # the modules behind the lazy imports below, for their result types
    from quantkit.engines.doctor import Report
    from quantkit.engines.smoke import SmokeResult
    from quantkit.engines.vllm.kernel_sweep import SweepResult
    from quantkit.formats.specs import MethodBase
    from quantkit.evaluation.evaluate import EvalOptions
    from quantkit.evaluation.results import EvalReport
    from quantkit.tasks.evaluate import TaskOptions
    from quantkit.tasks.resolve import Task
    from quantkit.tasks.results import TaskReport

__all__ = ["MANIFEST", "NO_PROGRESS", "ArtifactResult", "Manifest", "build_trt", "calibration_sets", "doctor",
           "evaluate", "evaluate_tasks", "eval_options", "task_options", "fmt_bytes", "fmt_num", "inspect",
           "load_recipe", "plan", "preview_calibration", "publish", "quantize", "quantize_one", "recipe_schema",
           "recipe_tasks", "show_recipe", "shipped_recipes", "size_bytes", "smoke", "trt_recipe", "tune", "verify",
           "verify_all"]


@dataclass
class ArtifactResult:
    """One artifact written: where, and its manifest."""

    path: Path
    manifest: Manifest

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {"path": str(self.path), "kind": m.kind, "method": m.method, "size_bytes": m.size_bytes,
                "timings": m.timings, "quantization": m.quantization,
                "calibration": m.calibration.model_dump(mode="json") if m.calibration else None,
                "notes": m.notes}


# ----------------------------------------------------------------------------------------------------------------
# Recipes


def installed_versions() -> dict[str, str]:
    """The installed versions of quantkit and its backends, as an artifact's manifest records them."""
    return versions.installed()


def load_recipe(path: str | Path | None, overrides: dict[str, Any] | None = None, base: dict[str, Any] | None = None,
                *, check_output_escape: bool = True) -> Recipe:
    """A recipe file or shipped recipe name (or none: ``base`` + flags), with flag overrides, validated."""
    found = recipe_mod.find(str(path)) if path is not None else None
    return recipe_mod.load(found, overrides, base, check_output_escape=check_output_escape)


def show_recipe(name: str) -> tuple[Path, Recipe]:
    """A recipe (path or shipped name), validated: its path and the object, every default filled in."""
    path = recipe_mod.find(name)
    return path, recipe_mod.load(path, check_output_escape=False)


def shipped_recipes() -> list[dict[str, str]]:
    """The recipes in ``recipes/``: name, path, and the description on each file's first comment line."""
    rows = []
    for p in sorted(recipe_mod.shipped_dir().glob("*.yaml")):
        first = next((ln[1:].strip() for ln in p.read_text().splitlines() if ln.startswith("#")), "")
        rows.append({"name": p.stem, "path": str(p), "description": first})
    return rows


def recipe_schema() -> dict[str, Any]:
    """The recipe's JSON schema (every field, its type, default and description)."""
    return Recipe.model_json_schema()


# ----------------------------------------------------------------------------------------------------------------
# Producing artifacts


HubReads = dict[tuple[str, str], calibration.Documents]  # a hub dataset's documents by (dataset, field)


def quantize_one(recipe: Recipe, spec: MethodBase, out: Path, *, force: bool = False, reporter: Reporter | None = None,
                 source: source_mod.SourceModel | None = None, hub_reads: HubReads | None = None) -> ArtifactResult:
    """Produce one output of a recipe into ``out`` (atomically, with its manifest). ``hub_reads``: the hub
    datasets an earlier output of the same command read, shared by its outputs (:func:`_hub_documents`).

    What the command line alone decides (the output apart from the inputs, and absent or replaceable) is refused
    first: before the source is resolved, its weights hashed or the producer's check run (llama.cpp's converter plans
    a GGUF file there)."""
    rep = reporter or Reporter(quiet=True)
    rep.timings = {}
    t0 = time.perf_counter()
    outputs.check_apart(out, outputs.local_source(recipe), outputs.recipe_inputs(recipe))
    artifact.check_output(out, force)
    if source is None:
        with rep.timed("check_source"):
            source = source_mod.resolve(recipe.model)
    outputs.check_apart(out, source.path)
    source.hash_weights()  # for the manifest, beside the work (a cached hash where the files did not change)
    prepared = plan_mod.prepare(recipe, spec, source)
    for warning in prepared.warnings:
        rep.warn(warning)
    if prepared.reads and (said := calibration.checked_repeat_warning(prepared.reads)):
        rep.warn_once(said)  # the documents the check read for the build: said before the work, not after it
    plan_mod.check_host_memory(recipe, spec, source)
    need = plan_mod.disk_need(prepared.producer, spec, source)
    with artifact.ArtifactWriter(out, force=force, expected_bytes=need) as w:
        ctx = ProduceContext(spec=spec, source=source, model=recipe.model, workdir=w.path,
                             calibration=recipe.calibration, runtime=recipe.runtime, reporter=rep,
                             checked=prepared.checked,
                             documents=_hub_documents(prepared.reads, rep, {} if hub_reads is None else hub_reads))
        produced = prepared.producer.produce(ctx)
        calib = produced.calibration
        rep.timings["total"] = round(time.perf_counter() - t0, 3)
        manifest = Manifest(
            kind=prepared.row.kind, method=spec.method, params=spec.model_dump(mode="json"),
            quantization=produced.quantization, source=source.manifest(),
            calibration=calib.manifest() if calib else None,
            recipe=recipe.model_dump(mode="json"), recipe_yaml=recipe_mod.dump(recipe),
            recipe_sha256=recipe.sha256(), output_sha256=recipe.output_sha256(spec),
            runtime=recipe.runtime.model_dump(mode="json"), versions=versions.installed(),
            timings=dict(rep.timings), notes=produced.notes)
        written = w.commit(manifest)
    return ArtifactResult(path=out, manifest=written)


def _hub_documents(reads: recipe_mod.CalibrationSpec | None, rep: Reporter,
                   hub_reads: HubReads) -> calibration.Documents | None:
    """A hub dataset's documents, read by the build before its producer starts and warned of there (repeats), then
    handed to the producer (``ProduceContext.documents``), which read them only as it tokenized, so a GPTQ of half an
    hour said the repeats at its end. The calibration check leaves a hub dataset to the run (a dry run stays offline),
    so nothing read it before; a shipped set or a local file the check read is warned of from its count
    (:func:`quantkit.calibration.checked_repeat_warning`). Read inside the artifact writer, as the producer read
    it: a hub that fails leaves nothing behind. Timed on its own (``calibration_documents``): under the tokenizing's
    key, the tokenizing step would show the two steps' time as its own. Read once per command: a ``quantkit run``
    of several outputs on one hub dataset read it for each (a request to the hub and the cache read again), where
    its outputs now take what the first read (``hub_reads``)."""
    if reads is None or not calibration.is_hub(reads.dataset):
        return None
    key = (reads.dataset, reads.field)
    if key not in hub_reads:
        with rep.step("calibration_documents", f"Reading hub dataset {reads.dataset!r}"):
            hub_reads[key] = calibration.load_documents(reads.dataset, reads.field)
    docs = hub_reads[key]
    if said := calibration.repeat_warning(docs):
        rep.warn_once(said)
    return docs


def quantize(recipe: Recipe, *, force: bool = False, reporter: Reporter | None = None) -> list[ArtifactResult]:
    """Produce every output of a recipe, in order (no evaluation: see :func:`quantkit.pipeline.run` for the whole
    pipeline)."""
    outputs.check_recipe(recipe, force=force)
    src = source_mod.resolve(recipe.model)
    hub_reads: HubReads = {}
    return [quantize_one(recipe, spec, out, force=force, reporter=reporter, source=src, hub_reads=hub_reads)
            for spec, out in recipe.artifacts()]


def trt_recipe(recipe_name: str, *, checkpoint_only: bool = False, python: str | None = None,
               output: str | None = None) -> Recipe:
    """A recipe for ``build-trt``: it must have TensorRT-LLM outputs (``method: trt``). ``python`` and ``output``
    override the recipe like any flag; ``checkpoint_only`` stops every TensorRT-LLM output after its checkpoints."""
    path = recipe_mod.find(recipe_name)
    r = load_recipe(path, {"runtime.python|--python": python, "output|--output": output})
    specs = [(spec, out) for spec, out in r.artifacts() if spec.method == Method.TRT]
    if not specs:
        got = r.quantize.method if r.quantize else ", ".join(sorted({o.method for o in r.outputs or []}))
        raise RecipeError(f"{path} has no TensorRT-LLM output (method: trt); it is {got}",
                          hint="`quantkit recipes trt-fp8` shows a TensorRT-LLM recipe")
    for spec, _ in specs:
        if checkpoint_only:
            spec.checkpoint_only = True  # validated on assignment, before anything is hashed
    return r


def build_trt(r: Recipe, *, force: bool = False, reporter: Reporter | None = None) -> list[ArtifactResult]:
    """A recipe's TensorRT-LLM outputs (see :func:`trt_recipe`): ModelOpt checkpoints, and the engine where it
    builds."""
    specs = [(spec, out) for spec, out in r.artifacts() if spec.method == Method.TRT]
    outputs.check_recipe(r, force=force)
    rep = reporter or Reporter(quiet=True)
    with rep.timed("check_source"):
        src = source_mod.resolve(r.model)
    hub_reads: HubReads = {}
    return [quantize_one(r, spec, out, force=force, reporter=rep, source=src, hub_reads=hub_reads)
            for spec, out in specs]


def plan(recipe: Recipe, *, force: bool = False, pipeline: bool = False, evaluate: bool = True,
         smoke: bool = True, method: str | None = None) -> plan_mod.Plan:
    """What making a recipe's outputs would do, checked and estimated without loading a weight (``--dry-run``;
    :mod:`quantkit.plan`). ``pipeline``: as ``quantkit run`` would (reuse, evaluation, smoke test); ``method``:
    only the outputs of that method (``build-trt``)."""
    outputs.check_recipe(recipe, force=force, pipeline=pipeline)
    tasks = recipe_tasks(recipe) if pipeline and evaluate else []
    return plan_mod.make(recipe, force=force, pipeline=pipeline, evaluate=evaluate, smoke=smoke, method=method,
                         tasks=tasks)


# ----------------------------------------------------------------------------------------------------------------
# Calibration data


def calibration_sets() -> list[dict[str, Any]]:
    """The shipped calibration and evaluation sets: name, documents, characters."""
    rows = []
    for name in calibration.SHIPPED:
        docs = calibration.load_documents(name)
        rows.append({"name": name, "documents": len(docs.items), "characters": sum(len(d) for d in docs.items)})
    return rows


def preview_calibration(source: str, *, model: str | None = None, samples: int = 8, seq_len: int = 512,
                        seed: int = 0, field: str = "text", chat_template: bool | None = None,
                        show: int = 3) -> dict[str, Any]:
    """A calibration source's documents, and with ``model`` the exact token samples and their sha256, built as the
    quantize verbs build them (``chat_template`` None: the recipe's default, as theirs), so the sha256 is the one
    an artifact's manifest will record; ``repeated``: how many documents repeat an earlier one. Each value is
    checked against the recipe schema first (the keywords are ``calib show``'s flags): a refusal names the flag,
    exit 2."""
    if show < 0:
        raise RecipeError(f"--show {show}: the number of documents to preview is 0 or more")
    asked = {} if chat_template is None else {"chat_template": chat_template}
    try:
        spec = recipe_mod.CalibrationSpec(dataset=source, samples=samples, seq_len=seq_len, seed=seed, field=field,
                                          **asked)
    except ValidationError as e:
        raise RecipeError("; ".join(f"--{str(err['loc'][0]).replace('_', '-')} {err['input']!r}: {err['msg']}"
                                    for err in e.errors())) from None
    docs = calibration.load_documents(source, field)
    info: dict[str, Any] = {"source": source, "kind": docs.kind, "documents": len(docs.items), "chat": docs.chat,
                            "repeated": calibration.repeated(docs), "source_sha256": docs.file_sha256,
                            "preview": [calibration.document_text(d)[:300] for d in docs.items[:show]]}
    if model:
        from transformers import AutoTokenizer

        calibration.check_fits(spec, source_mod.resolve(recipe_mod.ModelSpec(source=model)).config, model)
        tok = AutoTokenizer.from_pretrained(model)
        cs = calibration.build(spec, tok, docs)
        info["calibration"] = cs.manifest().model_dump(mode="json")
        info["first_sample"] = tok.decode(cs.samples[0])[:300]
    return info


# ----------------------------------------------------------------------------------------------------------------
# Checking artifacts


def verify(path: Path, reporter: Reporter | None = None) -> integrity.VerifyResult:
    """Re-hash an artifact's files against its manifest."""
    return integrity.verify(Path(path))


def verify_all(path: Path) -> list[integrity.VerifyResult]:
    """Verify an artifact, one file of an artifact, or a release folder (each artifact, then its SHA256SUMS); a
    clear error when there is none (:func:`quantkit.integrity.verify_tree`)."""
    return integrity.verify_tree(Path(path))


def eval_options(recipe_path: str | None = None, *, flags: dict[str, Any] | None = None,
                 gate_flags: dict[str, float | None] | None = None, **engine: Any) -> tuple[EvalOptions, str | None]:
    """The evaluation options from a recipe's ``verify`` block and flags (flags win), and the recipe's model.

    Without a recipe the artifacts' own recipes (then the schema defaults) decide the gates."""
    from quantkit.evaluation.evaluate import options_from

    return options_from(recipe_path, flags or {}, gate_flags or {}, **engine)


def evaluate(artifacts: list[Path], baseline: str | None = None, options: EvalOptions | None = None,
             reporter: Reporter | None = None) -> EvalReport:
    """Perplexity, KLD and top-1 of artifacts against their baseline (:mod:`quantkit.evaluation.evaluate`).

    Returns an ``EvalReport``; gates are checked and recorded, not raised: call ``report.raise_for_gates()``.
    """
    from quantkit.evaluation.evaluate import evaluate as _evaluate

    return _evaluate([Path(a) for a in artifacts], baseline, options, reporter)


def task_options(tasks: str | list[str], *, recipe_path: str | None = None, num_fewshot: int | None = None,
                 limit: int | None = None, min_recovery: float | None = None, engine: str | None = None,
                 device: str = "auto", python: str | None = None, report_dir: Path | None = None,
                 stall_timeout: float | None = None) -> TaskOptions:
    """``eval --tasks``'s options: the tasks (comma-separated or a list), each with the flags' few-shot and limit
    over the recipe's entry for that task (whose ``min_recovery`` gates are kept), ``--min-recovery`` over every
    gate, and where the models run."""
    from quantkit.tasks.evaluate import TaskOptions, task_specs
    from quantkit.tasks.runner import RunOptions

    names = [n.strip() for n in (tasks.split(",") if isinstance(tasks, str) else tasks) if n.strip()]
    spec = recipe_mod.EvaluationSpec()
    if recipe_path:
        spec = recipe_mod.load(recipe_mod.find(recipe_path), check_output_escape=False).evaluation
    run = RunOptions(device=device, python=python,
                     stall_timeout=spec.stall_timeout if stall_timeout is None else stall_timeout)
    return TaskOptions(tasks=task_specs(names, num_fewshot=num_fewshot, limit=limit,
                                        recipe_tasks=spec.tasks if recipe_path else None),
                       engine=engine or "auto", min_recovery=min_recovery, run=run, report_dir=report_dir)


def recipe_tasks(recipe: Recipe) -> list[Task]:
    """The recipe's lm-eval tasks, built and checked before anything loads (``run`` and its ``--dry-run``): a name
    lm-eval does not know or a gate on a metric a task does not report is a recipe error (exit 2), not a task skipped
    after hours of quantization with the release passing."""
    if not (recipe.evaluation.enabled and recipe.evaluation.tasks):
        return []
    from quantkit.tasks.resolve import TaskProblems, resolve

    try:
        return resolve(list(recipe.evaluation.tasks))
    except TaskProblems as e:  # every task's problem, each at its field and line, as the schema's are reported
        raise recipe.problems([(("evaluation", "tasks", p.index, p.key), p.error.message) for p in e.problems],
                              hint=e.hint) from None


def evaluate_tasks(artifacts: list[Path], baseline: str | None, options: TaskOptions,
                   reporter: Reporter | None = None) -> TaskReport:
    """lm-eval task accuracy of artifacts against their baseline, each in the engine that serves it
    (:mod:`quantkit.tasks.evaluate`). Gates are checked and recorded, not raised: call ``report.raise_for_gates()``."""
    from quantkit.tasks.evaluate import evaluate as _evaluate

    return _evaluate([Path(a) for a in artifacts], baseline, options, reporter)


def inspect(path: Path) -> dict[str, Any]:
    """What an artifact is: format, bits, scheme, size, compression vs the source, and its manifest check."""
    from quantkit.inspection import describe

    return describe(Path(path))


def smoke(path: Path, *, reporter: Reporter | None = None, **options: Any) -> SmokeResult:
    """Serve an artifact in its real engine and check it answers (see :class:`quantkit.engines.smoke.SmokeOptions`
    for the keywords); returns a :class:`quantkit.engines.smoke.SmokeResult` whose ``ok`` says whether every run
    passed."""
    from quantkit.engines import smoke as smoke_mod

    return smoke_mod.run(Path(path), smoke_mod.SmokeOptions(**options), reporter)


def doctor(path: Path | None = None, *, engine: str = "auto", python: str | None = None,
           env: dict[str, str] | None = None) -> Report:
    """Versions of quantkit's backends and the engine's, and whether the engine can read ``path``
    (a :class:`quantkit.engines.doctor.Report`)."""
    from quantkit.engines import doctor as doctor_mod

    return doctor_mod.check(Path(path) if path is not None else None, engine, python=python, env=env)


def tune(path: Path, *, reporter: Reporter | None = None, **options: Any) -> SweepResult:
    """Measure every vLLM kernel configuration for an artifact and record the fastest ``vllm serve`` command in its
    manifest (:mod:`quantkit.engines.vllm.tune`; keywords: :class:`quantkit.engines.vllm.tune.TuneOptions`). Returns
    the sweep's result."""
    from quantkit.engines.vllm import tune as tune_mod

    return tune_mod.run(Path(path), tune_mod.TuneOptions(**options), reporter)


def publish(folder: Path, repo: str, *, private: bool = False) -> list[dict[str, Any]]:
    """Re-verify then upload artifacts to the Hugging Face hub (:func:`quantkit.publish.publish`)."""
    from quantkit import publish as publish_mod

    return publish_mod.publish(Path(folder), repo, private=private)
