"""Task accuracy's results: one row per artifact, task and metric (baseline, artifact, recovery, standard errors),
the recovery gates, and the report as the manifest, the JSON and the tables carry it.

Recovery is artifact / baseline for a metric where higher is better (accuracy), baseline / artifact where lower is
(a perplexity): either way 1.0 is no loss and a gate ``min_recovery: R`` passes at R or more, as llm-compressor's
lm-eval configs gate. A baseline of zero leaves recovery undefined, which fails a gate rather than passing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import GateFailedError
from quantkit.tasks.resolve import Task
from quantkit.tasks.runner import Scores

HEADER = ("model", "engine", "task", "metric", "baseline", "artifact", "recovery", "n", "shots", "gate")


def recovery(baseline: float, value: float, higher_is_better: bool) -> float | None:
    """See the module docstring; None when the ratio is undefined."""
    num, den = (value, baseline) if higher_is_better else (baseline, value)
    return num / den if den else None


def _pm(value: float, err: float | None) -> str:
    return f"{value:.4f}" + (f" ± {err:.4f}" if err is not None else "")


@dataclass
class Row:
    """One artifact's figure on one task's metric, against the baseline's."""

    label: str
    engine: str
    task: Task
    metric: str
    baseline: float
    baseline_stderr: float | None
    value: float
    stderr: float | None
    recovery: float | None
    samples: int
    num_fewshot: int
    limit: float | None = None  # the gate's min recovery; None: no gate

    @property
    def passed(self) -> bool:
        return self.limit is None or (self.recovery is not None and self.recovery >= self.limit)

    @property
    def higher_is_better(self) -> bool:
        return self.task.metrics[self.metric]

    def describe(self) -> str:
        """The gate's line: task, metric, both scores, the recovery and its limit."""
        zero = "baseline 0" if self.higher_is_better else "artifact 0 on a lower-is-better metric"
        rec = f"undefined ({zero})" if self.recovery is None else f"{self.recovery:.4f}"
        return (f"{self.task.name} {self.metric}: artifact {self.value:.4f}, baseline {self.baseline:.4f}, recovery "
                f"{rec} (min {self.limit:g})")

    def cells(self) -> list[str]:
        gate = "none set" if self.limit is None else ("pass" if self.passed else "FAIL") + f" (≥ {self.limit:g})"
        return [self.label, self.engine, self.task.name, self.metric, _pm(self.baseline, self.baseline_stderr),
                _pm(self.value, self.stderr), "-" if self.recovery is None else f"{self.recovery:.4f}",
                str(self.samples), str(self.num_fewshot), gate]

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "engine": self.engine, "task": self.task.name, "metric": self.metric,
                "baseline": self.baseline, "baseline_stderr": self.baseline_stderr, "artifact": self.value,
                "artifact_stderr": self.stderr, "recovery": self.recovery,
                "higher_is_better": self.higher_is_better, "samples": self.samples,
                "num_fewshot": self.num_fewshot, "limit": self.task.spec.limit, "task_sha256": self.task.sha256,
                "min_recovery": self.limit, "passed": self.passed}


UNDEFINED_HINT = ("recovery is undefined where the baseline scores 0 on the samples scored (or the artifact 0 on a "
                  "lower-is-better metric), and an undefined recovery fails its gate: raise --limit (a recipe task's "
                  "limit) or pick a task the baseline scores on")
WORSE_HINT = "the artifact does the task worse than its baseline by more than the gate allows"


def _gate_hint(failed: list[Row]) -> str:
    """The cause of each kind of failure present: a gate failed on an undefined recovery says nothing about the
    artifact (it said "worse" of an artifact scoring 0.5 against a baseline's 0)."""
    causes = [UNDEFINED_HINT] if any(r.recovery is None for r in failed) else []
    if any(r.recovery is not None for r in failed):
        causes.append(WORSE_HINT)
    return "; ".join([*causes, "the full table is in the report"])


@dataclass
class Scored:
    """One model scored: where, in which engine, and its scores."""

    label: str
    path: Path
    engine: str
    scores: Scores
    manifest_dir: Path | None = None
    baseline_engine: str = ""


@dataclass
class TaskReport:
    """A whole ``eval --tasks`` run: the tasks, the baseline per engine, every artifact's rows."""

    tasks: list[Task]
    baselines: dict[str, Scored]  # baseline engine -> its scores
    artifacts: list[Scored]
    rows: list[Row] = field(default_factory=list)
    report_path: Path | None = None

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def failed(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def rows_of(self, label: str) -> list[Row]:
        return [r for r in self.rows if r.label == label]

    def table(self) -> tuple[tuple[str, ...], list[tuple[list[str], bool | None]]]:
        """The table's header and rows, each with its verdict (None: no gate)."""
        return HEADER, [(r.cells(), None if r.limit is None else r.passed) for r in self.rows]

    def raise_for_gates(self) -> None:
        """Exit 3 naming every failed gate: the artifact, the task, the metric and both scores."""
        failed = self.failed()
        if failed:
            raise GateFailedError(f"{len(failed)} task gate(s) failed:\n  "
                                  + "\n  ".join(f"{r.label}: {r.describe()}" for r in failed),
                                  hint=_gate_hint(failed))

    def baseline_json(self) -> dict[str, Any]:
        return {engine: {"label": b.label, "path": str(b.path), "engine": b.scores.engine, "cached": b.scores.cached,
                         "seconds": round(b.scores.seconds, 2), "scores": b.scores.to_json()["values"]}
                for engine, b in self.baselines.items()}

    def manifest(self, label: str) -> dict[str, Any]:
        """The manifest's ``evaluation.tasks`` for one artifact (or one GGUF file of it)."""
        mine = self.rows_of(label)
        scored = next(a for a in self.artifacts if a.label == label)
        base = self.baselines[scored.baseline_engine]
        return {"tasks": [t.manifest() for t in self.tasks], "engine": scored.scores.engine,
                "seconds": round(scored.scores.seconds, 2),
                "baseline": {"engine": base.scores.engine, "cached": base.scores.cached,
                             "seconds": round(base.scores.seconds, 2)},
                "rows": [r.to_json() for r in mine], "passed": all(r.passed for r in mine)}

    def to_json(self) -> dict[str, Any]:
        return {"tasks": [t.manifest() for t in self.tasks], "baselines": self.baseline_json(),
                "artifacts": [{"label": a.label, "path": str(a.path), "engine": a.scores.engine,
                               "seconds": round(a.scores.seconds, 2)} for a in self.artifacts],
                "rows": [r.to_json() for r in self.rows], "passed": self.passed,
                "report": str(self.report_path) if self.report_path else None}
