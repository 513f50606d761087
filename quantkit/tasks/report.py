"""``tasks.md`` and the manifests' ``evaluation.tasks``: what a task-accuracy run (:mod:`quantkit.tasks.evaluate`)
writes. Beside :mod:`quantkit.evaluation.report` (the perplexity run's report), whose engine line it shares."""

from __future__ import annotations

import os
from pathlib import Path

from quantkit import __version__, integrity
from quantkit.evaluation.report import engine_line
from quantkit.manifest import now_iso, read_manifest, write_text_atomic
from quantkit.tasks.results import TaskReport

TASKS_REPORT = "tasks.md"


def tasks_table(rows: list[list[str]], header: tuple[str, ...]) -> list[str]:
    """A markdown table (the task report's and the model card's)."""
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
        ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]


def tasks_markdown(report: TaskReport) -> str:
    """``tasks.md``: every artifact's recovery per task and metric, then how each model was scored."""
    header, rows = report.table()
    lines = ["# quantkit task accuracy", "",
             f"{len(report.artifacts)} artifact(s) against their baseline on {len(report.tasks)} lm-eval task(s).", ""]
    lines += tasks_table([cells for cells, _ in rows], header)
    lines += ["", "baseline and artifact: the metric ± lm-eval's standard error. recovery = artifact / baseline "
              "(baseline / artifact where lower is better); a gate passes at its minimum or above.", "",
              "## Tasks", ""]
    for t in report.tasks:
        lines.append(f"- `{t.name}` ({t.output_type}; {', '.join(t.metrics)}), from `{t.spec.task}`, few-shot "
                     f"{t.spec.num_fewshot if t.spec.num_fewshot is not None else 'the task default'}, limit "
                     f"{t.spec.limit or 'none'}, sha256 `{t.sha256}`")
    lines += ["", "## Models", ""]
    for engine, b in report.baselines.items():
        how = "from the cache (scored before on the same model, task and settings)" if b.scores.cached else \
            f"{b.scores.seconds:.1f} s"
        lines.append(f"- baseline `{b.path}` in {engine_line(b.scores.engine)}: {how}")
    for a in report.artifacts:
        lines.append(f"- `{a.label}` in {engine_line(a.scores.engine)}: {a.scores.seconds:.1f} s")
    lines += [f"- quantkit {__version__}, {now_iso()}", ""]
    return "\n".join(lines)


def write_tasks(report: TaskReport, out_dir: Path) -> None:
    """Write ``tasks.md`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TASKS_REPORT
    write_text_atomic(path, tasks_markdown(report))
    report.report_path = path


def update_task_manifests(report: TaskReport) -> None:
    """Record each artifact's task rows in its ``quantkit.json`` (``evaluation.tasks``), keeping the rest of the
    evaluation section, and re-seal the folder. A folder of several GGUF files gets one entry per file."""
    by_dir: dict[Path, list[str]] = {}
    for a in report.artifacts:
        if a.manifest_dir is not None:
            by_dir.setdefault(a.manifest_dir, []).append(a.label)
    for folder, labels in by_dir.items():
        previous = read_manifest(folder).evaluation
        section = previous.model_dump(mode="json") if previous else {}
        entries = {label: report.manifest(label) for label in labels}
        tasks = next(iter(entries.values())) if len(entries) == 1 else \
            {"files": entries, "passed": all(e["passed"] for e in entries.values())}
        tasks["created"] = now_iso()
        tasks["report"] = os.path.relpath(report.report_path, folder) if report.report_path else None
        integrity.update_manifest(folder, evaluation={**section, "tasks": tasks})
