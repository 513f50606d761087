"""``quantkit eval --tasks``: lm-eval tasks on the baseline and each artifact, recovery, gates, report, manifests.

    from quantkit.tasks.evaluate import TaskOptions, evaluate
    report = evaluate([Path("out/rtn")], None, TaskOptions(tasks=[TaskSpec(task="quantkit_lastword", limit=50)]))
    report.raise_for_gates()

Order of work: every check that needs no model first (the artifacts and their seals, the baseline, each task built
with its dataset, the gates' metrics, a loglikelihood task on a GGUF file, the engines' Pythons, where the report
goes); then the baseline once per engine it is needed in, each task's scores from the cache when they are there;
then each artifact in its engine. The baseline is scored where the artifact is: in vLLM or SGLang for an artifact
served there, else in transformers (llama-server reads only GGUF; a GGUF file's baseline is its source in
transformers). Results go into ``tasks.md`` and each artifact's manifest before any gate is enforced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from quantkit import outputs
from quantkit.engines import registry
from quantkit.errors import UsageError
from quantkit.tasks import report as report_mod
from quantkit.evaluation.evaluate import expand_targets, resolve_baseline
from quantkit.evaluation.results import Target
from quantkit.formats.names import LLAMACPP, SGLANG, TRANSFORMERS, VLLM
from quantkit.progress import Reporter
from quantkit.recipe import TaskSpec
from quantkit.source import SourceModel
from quantkit.tasks import baseline as cache, runner
from quantkit.tasks.resolve import Task, resolve
from quantkit.tasks.results import Row, Scored, TaskReport, recovery
from quantkit.tasks.runner import RunOptions, Scores


@dataclass
class TaskOptions:
    """What to score (the tasks with their few-shot, limit and gates), where, and the gate flag over them all."""

    tasks: list[TaskSpec]
    engine: str = "auto"
    min_recovery: float | None = None  # --min-recovery: every task and metric, over the recipe's
    run: RunOptions = field(default_factory=RunOptions)
    report_dir: Path | None = None
    write: bool = True
    use_cache: bool = True


def task_specs(names: list[str], *, num_fewshot: int | None = None, limit: int | None = None,
               recipe_tasks: list[TaskSpec] | None = None) -> list[TaskSpec]:
    """``--tasks`` as specs: the flags' few-shot and limit over the recipe's entry of the same task (whose gates
    are kept), else a bare spec."""
    by_name = {t.task: t for t in recipe_tasks or []}
    out = []
    for name in names:
        base = by_name.get(name, TaskSpec(task=name))
        out.append(base.model_copy(update={k: v for k, v in (("num_fewshot", num_fewshot), ("limit", limit))
                                           if v is not None}))
    return out


def baseline_engine(engine: str) -> str:
    """Where the baseline is scored for an artifact scored in ``engine`` (see the module docstring)."""
    return engine if engine in (VLLM, SGLANG) else TRANSFORMERS


def check_engines(tasks: list[Task], targets: list[Target]) -> None:
    """Refuse, before anything starts, a task llama-server cannot score: the loglikelihood kinds need ``echo``."""
    for t in targets:
        if t.engine != LLAMACPP:
            continue
        for task in tasks:
            if task.needs_logprobs:
                raise UsageError(f"{task.name} is a {task.output_type} task, which needs the prompt's "
                                 f"log-probabilities (echo); llama-server refuses echo, so {t.label} (GGUF) cannot "
                                 "be scored on it",
                                 hint="score GGUF files on a generation task (generate_until), e.g. "
                                      "quantkit_lastword_gen")


def _preflight(engines: set[str], python: str | None) -> None:
    """A served engine that cannot start here, said now rather than after the baseline has run."""
    for name in engines - {TRANSFORMERS}:
        if why := registry.engine_unavailable(name, python):
            raise UsageError(f"scoring tasks in {name}: {why}")


def _report_dir(options: TaskOptions, targets: list[Target]) -> Path:
    """``--report-dir``; else the artifact folder (one) or their common parent; else ./quantkit-eval."""
    if options.report_dir is not None:
        return Path(options.report_dir)
    homes = sorted({t.manifest_dir for t in targets if t.manifest_dir is not None})
    if homes and len(homes) == len({t.manifest_dir for t in targets}):
        common = Path(os.path.commonpath([h.resolve() for h in homes]))
        if len(homes) == 1 or common != Path(common.anchor):
            return homes[0] if len(homes) == 1 else common
    return Path("quantkit-eval")


def _baseline(src: SourceModel, engine: str, tasks: list[Task], options: TaskOptions, rep: Reporter) -> Scored:
    """The baseline's scores in ``engine``: each task from the cache when it is there, the rest scored (once)."""
    source = cache.identity(src)
    device = options.run.device if engine == TRANSFORMERS else "served"
    keys = {t.name: cache.key(source, t, {"engine": engine, "device": device}, options.run.key()) for t in tasks}
    found = {n: s for n, k in keys.items() if options.use_cache and (s := cache.load(k)) is not None}
    todo = [t for t in tasks if t.name not in found]
    label = f"{src.path.name} (baseline)"
    if found:
        rep.log(f"baseline in {engine}: {', '.join(sorted(found))} from the cache (same model, task and settings)")
    fresh = runner.score(label, engine, src.path, src.path, todo, options.run, rep) if todo else None
    if fresh is not None:
        for t in todo:
            cache.save(keys[t.name], Scores(values={t.name: fresh.values[t.name]},
                                            samples={t.name: fresh.samples[t.name]},
                                            num_fewshot={t.name: fresh.num_fewshot[t.name]}, engine=fresh.engine,
                                            seconds=fresh.seconds))
    values = {n: s.values[n] for n, s in found.items()} | (fresh.values if fresh else {})
    merged = Scores(values=values,
                    samples={n: s.samples[n] for n, s in found.items()} | (fresh.samples if fresh else {}),
                    num_fewshot={n: s.num_fewshot[n] for n, s in found.items()} | (fresh.num_fewshot if fresh else {}),
                    engine=fresh.engine if fresh else next(iter(found.values())).engine,
                    seconds=fresh.seconds if fresh else 0.0, cached=fresh is None)
    return Scored(label=label, path=src.path, engine=engine, scores=merged)


def _rows(scored: Scored, base: Scored, tasks: list[Task], options: TaskOptions) -> list[Row]:
    rows = []
    for t in tasks:
        for metric, higher in t.metrics.items():
            b, b_err = base.scores.values[t.name][metric]
            v, v_err = scored.scores.values[t.name][metric]
            limit = options.min_recovery if options.min_recovery is not None else t.gates.get(metric)
            rows.append(Row(label=scored.label, engine=scored.engine, task=t, metric=metric, baseline=b,
                            baseline_stderr=b_err, value=v, stderr=v_err, recovery=recovery(b, v, higher),
                            samples=scored.scores.samples[t.name], num_fewshot=scored.scores.num_fewshot[t.name],
                            limit=limit))
    return rows


def evaluate(paths: list[Path], baseline: str | None, options: TaskOptions,
             reporter: Reporter | None = None) -> TaskReport:
    """Score artifacts and their baseline on lm-eval tasks (see the module docstring); gates checked, not raised."""
    rep = reporter or Reporter(quiet=True)
    if not paths:
        raise UsageError("give at least one artifact to evaluate")
    if not options.tasks:
        raise UsageError("no task to score", hint="--tasks quantkit_lastword,quantkit_nextsentence")
    if options.min_recovery is not None and not 0.0 < options.min_recovery <= 10.0:
        raise UsageError(f"--min-recovery {options.min_recovery} is not a ratio in (0, 10]")
    targets = expand_targets(paths, options.engine)
    src = resolve_baseline(baseline, targets)
    with rep.step("tasks:resolve", "building the tasks (their data, their metrics)"):
        tasks = resolve(options.tasks)
    check_engines(tasks, targets)
    _preflight({t.engine for t in targets}, options.run.python)
    out_dir = _report_dir(options, targets)
    if options.write:
        outputs.check_files(out_dir, (report_mod.TASKS_REPORT,), src.path, [])
        outputs.check_outside_seals(out_dir, (report_mod.TASKS_REPORT,), [t.manifest_dir or t.path for t in targets])
    rep.log("tasks: " + "; ".join(f"{t.name} ({t.output_type}: {', '.join(t.metrics)})" for t in tasks))
    baselines = {e: _baseline(src, e, tasks, options, rep) for e in sorted({baseline_engine(t.engine)
                                                                             for t in targets})}
    report = TaskReport(tasks=tasks, baselines=baselines, artifacts=[])
    for t in targets:
        tokenizer = src.path if t.engine == LLAMACPP else t.path
        scores = runner.score(t.label, t.engine, t.path, tokenizer, tasks, options.run, rep)
        scored = Scored(label=t.label, path=t.path, engine=t.engine, scores=scores, manifest_dir=t.manifest_dir,
                        baseline_engine=baseline_engine(t.engine))
        report.artifacts.append(scored)
        report.rows += _rows(scored, baselines[scored.baseline_engine], tasks, options)
    if options.write:
        report_mod.write_tasks(report, out_dir)
        report_mod.update_task_manifests(report)
    return report

