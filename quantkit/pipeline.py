"""``quantkit run``: every output of a recipe, verified, bundled into a release folder, with one exit code.

Order of work: vet the source once; for each output, reuse the artifact if it is complete and was made from the
same source, output spec, calibration and library versions (so a failed pipeline resumes), else produce it;
evaluate all artifacts together against the baseline (its logits computed once); smoke-test each where its
engine is available (a skipped step is reported as skipped, never as passed); check the gates; write the
bundle: ``SHA256SUMS``, ``report.md`` + ``report.json`` + the size/perplexity plot, and a Hugging Face model
card (``README.md``) in each artifact. Gate failures are collected and raised last (exit 3), after the bundle
is written, so the report shows every artifact's numbers.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit import api, artifact, calibration, formats, integrity, outputs, plan as plan_mod, seal
from quantkit import source as source_mod
from quantkit.engines.vllm import tune as tune_mod
from quantkit.errors import GateFailedError, Interrupted, OutputExistsError, QuantkitError, UsageError
from quantkit.formats import kinds
from quantkit.formats.names import LLAMACPP, VLLM, KindName
from quantkit.integrity import BUNDLE_FILES, LOGS, REPORT_JSON, SUMS
from quantkit.locks import output_lock
from quantkit.manifest import MANIFEST, Manifest, read_manifest, write_text_atomic
from quantkit.progress import Reporter, fmt_num
from quantkit.recipe import Recipe, TaskSpec
from quantkit.reuse import reusable

if TYPE_CHECKING:
    from quantkit.formats.specs import MethodBase
    from quantkit.tasks.resolve import Task


@dataclass
class OutputResult:
    """One output of the pipeline and what happened to it at each step."""

    name: str
    method: str
    path: Path
    status: str = "pending"  # built | reused | failed
    error: str | None = None
    manifest: Manifest | None = None
    evaluation: dict[str, Any] | None = None
    smoke: dict[str, Any] | None = None
    gates: list[dict[str, Any]] = field(default_factory=list)

    def smoke_status(self, file: str | None = None) -> str:
        """The smoke result of the output, or of one of its files (a GGUF output serves each file on its own)."""
        smoke = self.smoke or {}
        runs = [r for r in smoke.get("runs") or [] if file is not None and r.get("file") == file]
        return str(runs[0].get("status", "?")) if runs else str(smoke.get("status", "skipped"))

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {"name": self.name, "method": self.method, "path": str(self.path), "status": self.status,
                "error": self.error, "kind": m.kind if m else None, "size_bytes": m.size_bytes if m else None,
                "timings": m.timings if m else None, "evaluation": self.evaluation,
                "smoke": self.smoke, "gates": self.gates}


@dataclass
class RunResult:
    """The whole run: every output, the release folder, and whether the release may ship."""

    release: Path
    outputs: list[OutputResult]
    seconds: float = 0.0

    @property
    def failed_gates(self) -> list[str]:
        return [f"{o.name}: {g['gate']} = {g['value']} (limit {g['limit']})"
                for o in self.outputs for g in o.gates if not g["passed"]]

    @property
    def failed_smoke(self) -> list[str]:
        return [f"{o.name}: {(o.smoke or {}).get('summary')}" for o in self.outputs
                if (o.smoke or {}).get("status") == "failed"]

    @property
    def failed_evaluation(self) -> list[str]:
        return [f"{o.name}: {(o.evaluation or {}).get('summary')}" for o in self.outputs
                if (o.evaluation or {}).get("status") == "failed"]

    @property
    def ok(self) -> bool:
        return (all(o.status in ("built", "reused") for o in self.outputs) and not self.failed_gates
                and not self.failed_smoke and not self.failed_evaluation)

    def check(self) -> None:
        """Raise the error a release pipeline should stop on: a failed gate (exit 3) or a failed output (1)."""
        if self.failed_gates:
            raise GateFailedError("verification gate failed: " + "; ".join(self.failed_gates))
        failed = [o for o in self.outputs if o.status == "failed"]
        if failed:
            raise QuantkitError("outputs failed: " + "; ".join(f"{o.name}: {o.error}" for o in failed))
        if self.failed_evaluation:
            raise QuantkitError("evaluation failed: " + "; ".join(self.failed_evaluation))
        if self.failed_smoke:
            raise QuantkitError("smoke test failed: " + "; ".join(self.failed_smoke))

    @property
    def bundle(self) -> list[str]:
        """The bundle's files this run left in the release (``report.md`` only where something was evaluated)."""
        return [n for n in BUNDLE_FILES if (self.release / n).is_file()]

    def to_json(self) -> dict[str, Any]:
        return {"release": str(self.release), "ok": self.ok, "seconds": round(self.seconds, 1),
                "failed_gates": self.failed_gates, "outputs": [o.to_json() for o in self.outputs]}


def run(recipe: Recipe, *, force: bool = False, reporter: Reporter | None = None, evaluate: bool = True,
        smoke: bool = True) -> RunResult:
    """Run a recipe end to end (see the module docstring); ``result.check()`` raises on failed gates or outputs."""
    rep = reporter or Reporter(quiet=True)
    t0 = time.perf_counter()
    release = Path(recipe.output)
    # A release of several outputs is one run's at a time: two would interleave their builds and bundles. (A
    # one-output recipe's release is its artifact folder, which the artifact's own lock already guards.)
    with output_lock(release) if recipe.outputs else contextlib.nullcontext():
        return _run(recipe, release, force=force, rep=rep, evaluate=evaluate, smoke=smoke, t0=t0)


def _run(recipe: Recipe, release: Path, *, force: bool, rep: Reporter, evaluate: bool, smoke: bool,
         t0: float) -> RunResult:
    outputs.check_recipe(recipe, force=force, pipeline=True)
    src = source_mod.resolve(recipe.model)
    outputs.check_recipe(recipe, force=force, pipeline=True, source=src.path)  # a hub id's cached folder too
    tasks = api.recipe_tasks(recipe) if evaluate else []
    if evaluate and recipe.evaluation.enabled:
        calibration.check_eval_field(recipe.evaluation.dataset, recipe.evaluation.field)
    results: list[OutputResult] = []
    reuse: list[tuple[MethodBase, OutputResult, str | None]] = []  # (spec, result, why it is reused, or None)
    for spec, out in recipe.artifacts():  # every refusal before the first change to the release
        res = OutputResult(name=formats.folder(spec) if recipe.outputs else out.name, method=spec.method, path=out)
        results.append(res)
        ok, why = reusable(recipe, spec, out, src)
        if out.exists() and not ok and not force:
            raise OutputExistsError(f"{out} exists but cannot be reused: {why}",
                                    hint="pass --force to rebuild it, or remove it")
        reuse.append((spec, res, why if ok and not force else None))
    if recipe.outputs:  # the last run's seal goes before anything changes: a run cut short must not leave it vouching
        for name in (SUMS, REPORT_JSON):
            (release / name).unlink(missing_ok=True)
        if release.is_dir():  # a killed run's half-built or moved-aside outputs, which SHA256SUMS would seal
            artifact.recover_leftovers(release)
    hub_reads: api.HubReads = {}  # a hub dataset's documents, read for the first output that calibrates on them
    for spec, res, why in reuse:
        out = res.path
        if why is not None:
            rep.log(f"[green]✓[/] {res.name}: reused ({why})")
            res.status, res.manifest = "reused", read_manifest(out)
            continue
        rep.log(f"[bold]▶ {res.name}[/] ({spec.method})")
        try:
            built = api.quantize_one(recipe, spec, out, force=True, reporter=rep, source=src, hub_reads=hub_reads)
        except QuantkitError as e:
            if len(recipe.artifacts()) == 1:
                raise
            res.status, res.error = "failed", str(e)
            rep.warn(f"{res.name} failed: {e}")
            continue
        res.status, res.manifest = "built", built.manifest

    done = [r for r in results if r.status in ("built", "reused")]
    checks = verification_sha256(recipe)
    todo = [r for r in done if force or r.status == "built" or not _recall(r, checks)]
    regated = [r for r in done if r not in todo and evaluate and _regate(r, recipe, tasks)]
    if regated:  # the same numbers under other limits: the last report's verdicts are this run's
        rep.log(f"[green]✓[/] evaluation reused ({', '.join(r.name for r in regated)}): the recorded figures, "
                "checked against this recipe's gates")
    found = {r.name: kinds.detect(r.path) for r in todo}  # each output's kind, read once for both steps
    if todo and evaluate and recipe.evaluation.enabled:
        steps = {r.name: plan_mod.evaluation_step(found[r.name], r.path, recipe) for r in todo}
        _evaluate(recipe, src, todo, steps, rep)
        for r in todo if tasks else []:
            _score_tasks(recipe, src, tasks, r, steps[r.name], rep)
    if todo and smoke and recipe.smoke.enabled:
        for r in todo:
            step = plan_mod.smoke_step(found[r.name], r.path, recipe)
            _smoke(recipe, r, step, rep)
            if recipe.smoke.tune_kernels:
                _tune(recipe, r, step, rep)
    if regated:
        _rewrite_report(release, done, recipe)
    for r in done:
        if not (evaluate and recipe.evaluation.enabled):
            r.evaluation = r.evaluation or {"status": "skipped", "summary": "evaluation turned off"}
        if not (smoke and recipe.smoke.enabled):
            r.smoke = r.smoke or {"status": "skipped", "summary": "smoke test turned off"}
        write_model_card(r, recipe, src)
        record = {"verification_sha256": checks, "evaluation": r.evaluation, "smoke": r.smoke, "gates": r.gates}
        r.manifest = integrity.update_manifest(r.path, pipeline=record)
    result = RunResult(release=release, outputs=results, seconds=time.perf_counter() - t0)
    write_bundle(result, recipe)
    if recipe.quantize is not None and (release / MANIFEST).exists():
        integrity.update_manifest(release)  # one-output recipe: the bundle files live in the artifact itself
    return result


def verification_sha256(recipe: Recipe) -> str:
    """Hash of what decides the verification's figures: the evaluation protocol, the tasks as scored, the smoke
    settings and the source. Results recorded under the same hash are reused on a re-run. The gates (``gates``, each
    task's ``min_recovery``) are left out: they are limits on the recorded figures, which a re-run checks again
    (:func:`_regate`) rather than re-scoring every model to change a threshold."""
    import hashlib

    protocol = recipe.evaluation.model_dump(mode="json", exclude={"gates": True,
                                                                  "tasks": {"__all__": {"min_recovery"}}})
    data = {"evaluation": protocol, "smoke": recipe.smoke.model_dump(mode="json"),
            "source": recipe.model.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _recall(r: OutputResult, checks: str) -> bool:
    """Reuse a reused artifact's recorded evaluation and smoke results when they were made the same way and
    neither failed: a failure may be the machine's (a server that stalled beside another), so a re-run tries again."""
    rec = r.manifest.pipeline if r.manifest else None
    if rec is None or rec.verification_sha256 != checks:
        return False
    if "failed" in ((rec.evaluation or {}).get("status"), (rec.smoke or {}).get("status")):
        return False
    if (rec.evaluation or {}).get("results") and "baseline" not in rec.evaluation:
        return False  # recorded before the baseline's figures were: the report could not be written again from it
    r.evaluation, r.smoke, r.gates = rec.evaluation, rec.smoke, rec.gates
    return True


def _regate(r: OutputResult, recipe: Recipe, tasks: list[Task]) -> bool:
    """Check a recalled evaluation's figures against this recipe's gates (the evaluation's and each task's
    ``min_recovery``), as scoring them would have; whether any verdict or limit differs from the recorded ones."""
    from quantkit.evaluation import gates as gates_mod

    ev = r.evaluation or {}
    before = r.gates
    limits = gates_mod.resolve({}, recipe.evaluation.gates)
    gates: list[dict[str, Any]] = []
    results = []
    for x in ev.get("results") or []:
        checked = [g.to_json() for g in gates_mod.check({k: x.get(k) for k in ("ppl_ratio", "kld", "top1")}, limits)]
        results.append({**x, "gates": checked, "passed": all(g["passed"] for g in checked)})
        gates += [{**g, "file": x.get("file")} for g in checked]
    by_name = {t.name: t for t in tasks}
    rows = []
    for x in ev.get("tasks") or []:
        task = by_name.get(x["task"])
        limit = task.gates.get(x["metric"]) if task else None
        passed = limit is None or (x["recovery"] is not None and x["recovery"] >= limit)
        rows.append({**x, "min_recovery": limit, "passed": passed})
        if limit is not None:
            gates.append(_task_gate(rows[-1]))
    ev = {**ev, "results": results} if "results" in ev else dict(ev)
    if "tasks" in ev:
        ev["tasks"] = rows
    if skipped := ev.get("tasks_skipped"):
        ev["tasks_skipped"] = {**skipped, "gates_not_checked": [
            f"min_recovery {name} {m} >= {x:g}" for name in skipped["tasks"] if name in by_name
            for m, x in by_name[name].gates.items()]}
    r.evaluation, r.gates = ev, gates
    if gates == before:
        return False
    _rewrite_tasks_report(r, by_name)
    return True


def _rewrite_tasks_report(r: OutputResult, tasks: dict[str, Task]) -> None:
    """The gate column of the output's ``tasks.md`` under this run's limits: each recorded row rendered again as
    the task run renders it (its figures unchanged), in place of the line the last run wrote with its own limits."""
    from quantkit.tasks.report import TASKS_REPORT, tasks_table
    from quantkit.tasks.results import HEADER, Row

    path = r.path / TASKS_REPORT
    recorded = [x for x in (r.evaluation or {}).get("tasks") or [] if x["task"] in tasks]
    if not recorded or not path.is_file():
        return
    lines = {}
    for x in recorded:
        row = Row(label=x["label"], engine=x["engine"], task=tasks[x["task"]], metric=x["metric"],
                  baseline=x["baseline"], baseline_stderr=x["baseline_stderr"], value=x["artifact"],
                  stderr=x["artifact_stderr"], recovery=x["recovery"], samples=x["samples"],
                  num_fewshot=x["num_fewshot"], limit=x["min_recovery"])
        line = tasks_table([row.cells()], HEADER)[-1]
        lines[line.rsplit(" | ", 1)[0]] = line  # keyed by every cell but the gate's
    text = path.read_text()
    write_text_atomic(path, "".join(lines.get(line.rsplit(" | ", 1)[0], line) + "\n"
                                             for line in text.splitlines()))


def _rewrite_report(release: Path, done: list[OutputResult], recipe: Recipe) -> None:
    """``report.md`` and its plot again, from the outputs' records (recalled or scored now, one protocol) under this
    run's gates: a recalled evaluation's report was written with the last run's limits, and a release's report must
    give the verdicts its ``report.json`` gives."""
    from types import SimpleNamespace

    from quantkit.evaluation import gates as gates_mod, report as report_mod
    from quantkit.evaluation.results import EvalReport, Result

    records = [(r, x) for r in done for x in (r.evaluation or {}).get("results") or []]
    if not records:
        return
    limits = gates_mod.resolve({}, recipe.evaluation.gates)
    ev = records[0][0].evaluation or {}
    p = ev["protocol"]
    protocol = SimpleNamespace(**{**p, "windows": range(p["windows"])})  # the recorded protocol, as report.md reads it
    report = EvalReport(protocol=protocol,  # type: ignore[arg-type]
                        baseline=Result.from_json(ev["baseline"], None, limits),
                        results=[Result.from_json(x, r.path, limits) for r, x in records],
                        kld_method=ev.get("kld_method", ""))
    report_mod.write(report, release, Reporter(quiet=True))


def _evaluate(recipe: Recipe, src: source_mod.SourceModel, done: list[OutputResult], steps: dict[str, plan_mod.Step],
              rep: Reporter) -> None:
    """All artifacts in one evaluation run, each read where its kind says (``steps``, :func:`quantkit.plan.
    evaluation_step`: a build-trt artifact's hf/ in vLLM): the baseline's logits are computed once and reused for
    each. An artifact its engine refuses before loading (a layout transformers cannot reload, a ModelOpt export
    vLLM has no method for) or whose engine cannot run here (vLLM missing, no GPU) is recorded as skipped with why,
    and the others are still scored. An engine that fails on the way (a server that stalls or dies) fails the
    evaluation of these artifacts, recorded as such; the run goes on to smoke and the bundle, and exits 1 at the
    end."""
    from quantkit.evaluation.evaluate import EvalOptions

    options = EvalOptions.from_spec(recipe.evaluation, report_dir=Path(recipe.output), python=recipe.smoke.python)
    scored = []
    for r in done:
        step = steps[r.name]
        if step.skipped:
            r.evaluation = {"status": "skipped", "engine": step.engine, "summary": step.skipped}
            rep.log(f"[yellow]-[/] evaluation of {r.name}: skipped ({step.skipped})")
            continue
        scored.append(r)
    if not scored:
        return
    try:
        report = api.evaluate([steps[r.name].folder for r in scored], str(src.path), options, rep)
    except (UsageError, Interrupted):
        raise
    except QuantkitError as e:  # an engine failed (a server that stalled or died): smoke and the bundle still run
        summary = e.message.splitlines()[0]
        for r in scored:
            r.evaluation = {"status": "failed", "summary": summary}
        rep.warn(f"evaluation failed: {summary}")
        return
    for r in done:
        mine = [x for x in report.results
                if x.target.manifest_dir and x.target.manifest_dir.resolve() == r.path.resolve()]
        if not mine:
            continue
        rows = [x.to_json() for x in mine]
        r.evaluation = {"baseline_ppl": report.baseline.metrics.ppl, "protocol": report.protocol.manifest(),
                        "baseline": report.baseline.to_json(), "kld_method": report.kld_method,
                        "results": [{**row, "file": Path(row["path"]).name if row["path"].endswith(".gguf") else None}
                                    for row in rows]}
        r.gates = [{**g.to_json(), "file": Path(x.target.path).name if str(x.target.path).endswith(".gguf") else None}
                   for x in mine for g in x.gates]


def _score_tasks(recipe: Recipe, src: source_mod.SourceModel, tasks: list[Task], r: OutputResult,
                 step: plan_mod.Step, rep: Reporter) -> None:
    """The recipe's lm-eval tasks (built and checked before the run began) on one artifact, read where its
    evaluation reads it (``step``; :mod:`quantkit.tasks`; the baseline's scores come from the cache after the first
    artifact): its rows into its evaluation record, its recovery gates into its gates, ``tasks.md`` into its folder.
    A task its engine cannot score (:func:`quantkit.plan.unscored_tasks`: every one where the evaluation is skipped,
    a GGUF output's loglikelihood and multiple-choice ones) is recorded as skipped, with why, and so is each of its
    gates, as not checked (never as passed: the summary, report.json and the model card say so)."""
    from quantkit.tasks.evaluate import TaskOptions
    from quantkit.tasks.runner import RunOptions

    skipped, why = plan_mod.unscored_tasks(tasks, step) or ([], "")
    scored = [t for t in tasks if t not in skipped]
    if scored:
        specs: list[TaskSpec] = []
        for t in scored:  # a group's members share their spec: it is scored once
            if t.spec not in specs:
                specs.append(t.spec)
        options = TaskOptions(tasks=specs, engine=recipe.evaluation.engine,
                              run=RunOptions(device=recipe.runtime.device, python=recipe.smoke.python,
                                             stall_timeout=recipe.evaluation.stall_timeout))
        try:
            report = api.evaluate_tasks([step.folder], str(src.path), options, rep)
        except UsageError as e:  # the engine cannot score it here (not installed, refuses the artifact)
            skipped, why = tasks, e.message
        else:
            rows = [row.to_json() for row in report.rows]
            r.evaluation = {**(r.evaluation or {}), "tasks": rows}
            r.gates += [_task_gate(x) for x in rows if x["min_recovery"] is not None]
    if not skipped:
        return
    unchecked = [f"min_recovery {t.name} {m} >= {x:g}" for t in skipped for m, x in t.gates.items()]
    rep.log(f"[yellow]-[/] tasks of {r.name}: {', '.join(t.name for t in skipped)} skipped ({why})"
            + (f"; not checked: {', '.join(unchecked)}" if unchecked else ""))
    r.evaluation = {**(r.evaluation or {}),
                    "tasks_skipped": {"tasks": [t.name for t in skipped], "why": why, "gates_not_checked": unchecked}}


def _task_gate(row: dict[str, Any]) -> dict[str, Any]:
    """One task row's recovery gate, as the run records it among the output's gates (``row``: a task row's JSON)."""
    return {"gate": f"min_recovery {row['task']} {row['metric']} (artifact {row['artifact']:.4f}, baseline "
                    f"{row['baseline']:.4f})", "value": row["recovery"], "limit": row["min_recovery"],
            "passed": row["passed"], "file": Path(row["label"]).name if row["label"].endswith(".gguf") else None}


def _smoke(recipe: Recipe, r: OutputResult, step: plan_mod.Step, rep: Reporter) -> None:
    """Smoke-test one artifact, the folder its kind's engine serves (``step``, :func:`quantkit.plan.smoke_step`),
    where that engine reads it and can run; otherwise record the step as skipped, with why."""
    from quantkit.engines import serving

    engine = step.engine
    if step.skipped or engine is None:
        r.smoke = {"status": "skipped", "engine": engine, "summary": step.skipped}
        rep.log(f"[yellow]-[/] smoke {r.name}: skipped ({step.skipped})")
        return
    res = api.smoke(step.folder, reporter=rep, engine=engine, python=recipe.smoke.python, timeout=recipe.smoke.timeout,
                    stall_timeout=recipe.smoke.stall_timeout,
                    tp=1 if serving.get(engine).no_tensor_parallel else recipe.smoke.tp,
                    log_dir=Path(recipe.output) / LOGS)
    data = res.to_json()
    errors = [run.get("error") for run in data["runs"] if run.get("error")]
    r.smoke = {"status": "passed" if res.ok else "failed", "engine": engine, "runs": data["runs"],
               "summary": f"{len(data['runs'])} server run(s) answered" if res.ok else "; ".join(map(str, errors))}


def _tune(recipe: Recipe, r: OutputResult, step: plan_mod.Step, rep: Reporter) -> None:
    """``smoke.tune_kernels``: measure vLLM's kernels for an output vLLM serves (the folder it serves, ``step``;
    recorded in its manifest), or say why not. A sweep that fails is a warning: the artifact's own smoke result
    decides whether it ships."""
    why = f"{step.engine} serves it (one kernel per type)" if step.engine != VLLM else step.skipped
    if why:
        rep.log(f"[yellow]-[/] kernel sweep {r.name}: skipped ({why})")
        return
    try:
        api.tune(step.folder, reporter=rep, python=recipe.smoke.python, log_dir=Path(recipe.output) / LOGS /
                 f"{r.name}.tune")
    except QuantkitError as e:
        rep.warn(f"kernel sweep of {r.name} failed: {e}")
        return
    r.manifest = read_manifest(r.path)


def write_model_card(r: OutputResult, recipe: Recipe, src: source_mod.SourceModel) -> None:
    """A Hugging Face model card for one artifact: metadata header, recipe, evaluation table, smoke result.

    ``base_model`` is the hub id the model came from: the hub reads it as one (and links the two), so a local source
    gets the one its recipe names (``model.base_model``, the repository it was downloaded from) or none, never a path
    of the machine that made it. The card is public (``publish`` uploads it): every value is shown as :func:`_public`
    gives it, with no path of this machine; the manifest beside it is the build record and keeps them."""
    from dataclasses import replace

    m = r.manifest
    assert m is not None, "only built or reused outputs get a model card"
    hub = src.spec if src.from_hub else recipe.model.base_model
    base = hub or Path(src.spec).name
    tags = ["quantkit", r.method, m.kind]
    if m.kind == KindName.GGUF:
        tags.append(LLAMACPP)
    if m.kind == KindName.COMPRESSED_TENSORS:
        tags += [VLLM, "llm-compressor"]
    header = ({"base_model": base, "base_model_relation": "quantized"} if hub else {}) | {
        "library_name": _library(m.kind), "tags": sorted({t for t in tags if t}), "pipeline_tag": "text-generation"}
    import yaml

    lines = ["---", yaml.safe_dump(header, sort_keys=False).strip(), "---", "",
             f"# {Path(base).name} - {r.name}", "",
             f"Quantized from `{base}` with quantkit {m.quantkit_version} "
             f"({r.method if r.method == m.kind else f'{r.method}, {m.kind}'}).", "",
             "## Quantization", ""]
    lines += ["| field | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in _public(m.quantization).items()
                                                     if k != "imatrix"]
    if m.quantization.get("imatrix"):
        lines += ["", imatrix_line(m.quantization["imatrix"])]
    cal = m.calibration
    if cal:
        lines += ["", f"Calibration: `{_public(cal.dataset)}`, {cal.samples} samples x {cal.seq_len} tokens, "
                      f"token sha256 `{cal.tokens_sha256}`."]
    # The recipe as it was when the artifact was built: a later run that reuses the artifact may evaluate it with
    # other settings, which the Evaluation section states for itself.
    lines += ["", "Build recipe (what made this artifact; the evaluation below states its own protocol and gates):",
              "", "```yaml", _public_recipe(m.recipe_yaml, src).strip(), "```"]
    shown = replace(r, evaluation=_public(r.evaluation), smoke=_public(r.smoke))
    lines += _evaluation_section(shown)
    if shown.smoke:
        lines += ["", "## Smoke test", "", f"{shown.smoke.get('status', '?')}: {shown.smoke.get('summary', '')}"]
    lines += tune_mod.card_section(_public(m.serving.model_dump(mode="json")) if m.serving else None)
    lines += ["", "## Versions", "", "| library | version |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in m.versions.items()]
    write_text_atomic(r.path / "README.md", "\n".join(lines) + "\n")


# An absolute path of this machine within a value (a tool's folder, a calibration file, the folder a baseline was read
# from, a served artifact): after no word character, URL's "://" or path character, so "org/model", "bf16/fp16",
# "./data.jsonl" and URLs are left as they are.
_LOCAL_PATH = re.compile(r"(?<![\w.:/~-])~?/[^\s'\"`,;()|<>\[\]{}]+")


def _public(value: Any) -> Any:
    """A manifest value as the public model card shows it: each absolute path of this machine by its last part (the
    file's or folder's name), a tool quantkit ran (a dict with ``tool``) by :func:`_tool_line`, through dicts and
    lists. qa3 found the converter's cache folder, llama-quantize's path and the source's in a published card."""
    if isinstance(value, dict):
        return _tool_line(value) if "tool" in value else {k: _public(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_public(v) for v in value]
    if isinstance(value, str):
        return _LOCAL_PATH.sub(lambda found: Path(found.group()).name or found.group(), value)
    return value


def _tool_line(tool: dict[str, Any]) -> str:
    """A tool as the card names it, by name and build, not where it was found (that stays in the manifest):
    ``convert_hf_to_gguf.py b11312 (0c1e57098), built for llama-cpp-python 0.3.36``."""
    build = f" b{tool['build_number']}" if tool.get("build_number") else ""
    commit = f" ({tool['commit']})" if tool.get("commit") else ""
    made_for = f", built for {tool['built_for']}" if tool.get("built_for") else ""
    return f"{tool['tool']}{build}{commit}{made_for}"


def _public_recipe(recipe_yaml: str, src: source_mod.SourceModel) -> str:
    """The build recipe as the card shows it: a local source by its folder's name (a hub source as given), every
    other path of this machine by its name (:func:`_public`)."""
    import yaml

    data = yaml.safe_load(recipe_yaml)
    if not src.from_hub:
        data["model"]["source"] = Path(data["model"]["source"]).name
    return yaml.safe_dump(_public(data), sort_keys=False)


def imatrix_line(im: dict[str, Any]) -> str:
    """The model card's sentence about a GGUF importance matrix: which file, made from what, applied to which types
    by which llama-quantize (named as the card names every tool: :func:`_tool_line`)."""
    made = (f"computed by quantkit from the calibration tokens (sha256 `{im['calibration_tokens_sha256']}`)"
            if im.get("source") == "calibration" else f"given as `{Path(im.get('given', '')).name}`")
    tool = _tool_line({"tool": "llama-quantize", **(im.get("applied_by") or {})})
    return (f"Importance matrix: `{im['file']}` ({im['format']}, {im['entries']} entries, sha256 `{im['sha256']}`), "
            f"{made}; applied to {', '.join(im.get('types') or [])} by {tool}.")


def _library(fmt: str | None) -> str:
    return {KindName.GGUF: "gguf", KindName.COMPRESSED_TENSORS: "transformers"}.get(fmt or "", "transformers")


def _evaluation_section(r: OutputResult) -> list[str]:
    """The card's evaluation: the protocol the numbers come from, the figures, task accuracy, and every gate with its
    verdict, all from this run's evaluation (never the build recipe's settings)."""
    ev = r.evaluation
    if not ev:
        return []
    lines = ["", "## Evaluation", ""] + _protocol_lines(ev) + _eval_table(ev, r.name)
    if isinstance(ev.get("tasks"), list):
        lines += ["", "## Task accuracy", ""] + _tasks_table(ev["tasks"])
    if skipped := ev.get("tasks_skipped"):
        lines += ["", f"Not scored: {', '.join(skipped['tasks'])} ({skipped['why']})"
                  + (f"; gates not checked: {', '.join(skipped['gates_not_checked'])}."
                     if skipped.get("gates_not_checked") else ".")]
    return lines + ["", "## Gates", ""] + _gate_lines(r.gates)


def _protocol_lines(ev: dict[str, Any]) -> list[str]:
    """The card's sentence saying what the numbers below were measured on and with: the run's evaluation protocol,
    which may differ from the build recipe's when a later run re-evaluated a reused artifact."""
    from quantkit.evaluation.report import engine_line

    p = ev.get("protocol")
    if not p:
        return []
    engines = sorted({engine_line({k: v for k, v in (x.get("engine") or {}).items() if k in ("engine", "version",
                                                                                                "device")})
                      for x in ev.get("results") or []})
    windows = f"stride {p['stride']}" if p.get("stride") else "non-overlapping windows"
    return [f"Protocol: {p['tokens_scored']:,} tokens of `{p['source']}` (dataset `{p['dataset']}`), ctx {p['ctx']}, "
            f"{windows}" + (f"; engine {', '.join(engines)}" if engines else "")
            + f"; baseline perplexity {fmt_num(ev.get('baseline_ppl'))}.", ""]


def _eval_table(ev: dict[str, Any], name: str) -> list[str]:
    """Perplexity, ratio, KLD and top-1 of each file scored (a GGUF output's files each have a row; another output's
    one row is named by the output), or the step's status where it scored nothing."""
    rows = ev.get("results")
    if not rows:
        return [f"{ev.get('status', '?')}: {ev.get('summary', '')}"]
    out = ["| file | ppl | ppl ratio | KLD | top-1 |", "| --- | --- | --- | --- | --- |"]
    f = fmt_num
    for x in rows:
        out.append(f"| {x.get('file') or name} | {f(x.get('ppl'))} | {f(x.get('ppl_ratio'))} | "
                   f"{f(x.get('kld'), 4)} | {f(x.get('top1'))} |")
    return out


def _tasks_table(rows: list[dict[str, Any]]) -> list[str]:
    """The model card's lm-eval table: each task and metric, baseline and artifact with their standard errors; with
    the file each row scored when the rows come from several (a GGUF output scores each of its files)."""
    def pm(x: float, err: float | None) -> str:
        return f"{x:.4f}" + (f" ± {err:.4f}" if err is not None else "")

    files = len({x.get("label") for x in rows}) > 1
    head = ("file", "task", "metric", "baseline", "artifact", "recovery", "items", "few-shot")[0 if files else 1:]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for x in rows:
        rec = "-" if x["recovery"] is None else f"{x['recovery']:.4f}"
        out.append("| " + (f"{Path(x['label']).name} | " if files else "")
                   + f"{x['task']} | {x['metric']} | {pm(x['baseline'], x['baseline_stderr'])} | "
                   f"{pm(x['artifact'], x['artifact_stderr'])} | {rec} | {x['samples']} | {x['num_fewshot']} |")
    return out


def _gate_lines(gates: list[dict[str, Any]]) -> list[str]:
    """Each gate this run checked (its evaluation's limits, not the build recipe's), with its value and verdict."""
    from quantkit.evaluation.gates import GATES

    if not gates:
        return ["No gate was checked."]
    failed = sum(not g["passed"] for g in gates)
    out = ["All gates pass." if not failed else f"**{failed} gate(s) failed.**", ""]
    for g in gates:
        op = GATES[g["gate"]][1] if g["gate"] in GATES else ">="
        value = "not measured" if g["value"] is None else f"{g['value']:.4g}"
        out.append(f"- {g['file'] + ': ' if g.get('file') else ''}{g['gate']}: {value} (limit {op} {g['limit']:g}) "
                   + ("pass" if g["passed"] else "FAIL"))
    return out


def write_bundle(result: RunResult, recipe: Recipe) -> None:
    """``report.json``, then ``SHA256SUMS`` over every file of the release (:func:`quantkit.integrity.release_files`,
    hashed several at once). A one-output release is its artifact: its manifest is left out of the list, since it is
    rewritten after it to record the bundle's files (and so seals them itself); listed, it was always stale."""
    release = result.release
    release.mkdir(parents=True, exist_ok=True)
    write_text_atomic(release / REPORT_JSON, json.dumps(result.to_json(), indent=2, default=str) + "\n")
    files = [p for p in integrity.release_files(release) if recipe.outputs or p != release / MANIFEST]
    sums = sorted((p.relative_to(release).as_posix(), digest) for p, digest in seal.hash_many(files))
    write_text_atomic(release / SUMS, "".join(f"{digest}  {rel}\n" for rel, digest in sums))
