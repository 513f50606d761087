"""What an evaluation produces: the models scored (:class:`Target`), each one's figures (:class:`Result`) and the
whole run (:class:`EvalReport`).

These types are shared by :mod:`.evaluate` (which makes them) and :mod:`.report` (which writes them), so they
live here, importing neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.manifest import Manifest
from quantkit.progress import fmt_bytes
from quantkit.recipe import GateSpec
from quantkit.evaluation import gates as gates_mod, protocol as protocol_mod
from quantkit.evaluation.metrics import Metrics


HEADER = ("model", "engine", "format", "size", "bits/weight", "ppl", "ratio", "KLD", "top-1", "gates")


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def row(r: Result, is_baseline: bool = False) -> list[str]:
    """One table row, as text (shared by report.md and the CLI's summary table: :meth:`EvalReport.table`)."""
    m = r.metrics
    if is_baseline:
        verdict = "baseline"
    elif not r.gates:
        verdict = "none set"
    else:
        verdict = "pass" if r.passed else "FAIL: " + ", ".join(g.gate for g in r.gates if not g.passed)
    engine = str(r.engine.get("engine", r.target.engine)) + (f" ({r.numerics})" if r.numerics else "")
    return [r.target.label, engine, r.target.format,
            fmt_bytes(r.target.size_bytes), _num(r.bits_per_weight, ".2f"), _num(m.ppl, ".4f"),
            _num(r.ppl_ratio, ".4f"), _num(m.kld, ".3g"), _num(m.top1, ".4f"), verdict]


@dataclass
class Target:
    """One model to score: a checkpoint folder or one GGUF file, and the artifact folder whose manifest it updates."""

    label: str
    path: Path
    engine: str
    manifest_dir: Path | None
    manifest: Manifest | None
    format: str
    size_bytes: int
    gates: GateSpec | None = None


@dataclass
class Result:
    """One model's figures against the baseline."""

    target: Target
    engine: dict[str, Any]
    metrics: Metrics
    ppl_ratio: float | None
    bits_per_weight: float | None
    seconds: float
    gates: list[gates_mod.GateResult] = field(default_factory=list)
    kld_method: str | None = None  # set when it differs from the run's (a sparse engine's bound)
    images: dict[str, Any] | None = None  # a vision-language model's image prompts (quantkit.evaluation.images)
    numerics: str | None = None  # an FP4 W4A4 artifact: the arithmetic measured (quantkit.engines.numerics)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def figures(self) -> dict[str, float | None]:
        return {"ppl_ratio": self.ppl_ratio, "kld": self.metrics.kld, "top1": self.metrics.top1}

    def to_json(self) -> dict[str, Any]:
        t = self.target
        return {"label": t.label, "path": str(t.path), "format": t.format, "engine": self.engine,
                "size_bytes": t.size_bytes, "bits_per_weight": self.bits_per_weight, **self.metrics.to_json(),
                "ppl_ratio": self.ppl_ratio, "seconds": round(self.seconds, 2),
                "gates": [g.to_json() for g in self.gates], "passed": self.passed,
                **({"kld_method": self.kld_method} if self.kld_method else {}),
                **({"numerics": self.numerics} if self.numerics else {}),
                **({"images": self.images} if self.images is not None else {})}

    @classmethod
    def from_json(cls, x: dict[str, Any], folder: Path | None, limits: GateSpec) -> "Result":
        """A result as :meth:`to_json` recorded it (a run's manifest or report.json), under ``limits``: what a
        re-run that reuses the figures renders again with its own gates. ``folder``: the artifact it belongs to."""
        target = Target(label=x["label"], path=Path(x["path"]), engine=str(x["engine"].get("engine")),
                        manifest_dir=folder, manifest=None, format=x["format"], size_bytes=x["size_bytes"],
                        gates=limits)
        metrics = Metrics(**{k: x.get(k) for k in Metrics.__dataclass_fields__})
        metrics.ppl = float("nan") if metrics.ppl is None else metrics.ppl  # null in JSON: a non-finite figure
        return cls(target=target, engine=x["engine"], metrics=metrics, ppl_ratio=x.get("ppl_ratio"),
                   bits_per_weight=x.get("bits_per_weight"), seconds=x.get("seconds") or 0.0,
                   gates=[gates_mod.GateResult(**{k: g[k] for k in ("gate", "metric", "value", "limit", "passed")})
                          for g in x.get("gates") or []],
                   kld_method=x.get("kld_method"), numerics=x.get("numerics"), images=x.get("images"))


@dataclass
class EvalReport:
    """Everything one evaluation run measured, and where it wrote its report."""

    protocol: protocol_mod.Protocol
    baseline: Result
    results: list[Result]
    kld_method: str
    report_path: Path | None = None
    plot_path: Path | None = None

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def table(self) -> tuple[tuple[str, ...], list[tuple[list[str], bool | None]]]:
        """The summary table: its header, and its rows (baseline first) each with its verdict: None for the
        baseline, else whether the model passed its gates."""
        return HEADER, [(row(self.baseline, is_baseline=True), None)] + [(row(r), r.passed) for r in self.results]

    def raise_for_gates(self) -> None:
        """Raise :class:`~quantkit.errors.GateFailedError` (exit 3) when any artifact failed a gate."""
        gates_mod.enforce({r.target.label: r.gates for r in self.results})

    def to_json(self) -> dict[str, Any]:
        return {"protocol": self.protocol.manifest(), "kld_method": self.kld_method,
                "baseline": self.baseline.to_json(), "results": [r.to_json() for r in self.results],
                "passed": self.passed, "report": str(self.report_path) if self.report_path else None,
                "plot": str(self.plot_path) if self.plot_path else None}
