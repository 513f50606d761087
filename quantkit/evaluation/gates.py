"""Release gates: the limits an artifact's evaluation must meet, and the error that stops a release.

Three gates, each optional: ``max_ppl_ratio`` (artifact perplexity / baseline perplexity), ``max_kld`` (mean
KL(baseline || artifact) in nats per token) and ``min_top1`` (share of tokens whose most likely next token
agrees). Limits come from, in order of precedence: the command-line flags, the ``evaluation.gates`` block of
``--recipe``, the recipe recorded in the artifact's manifest, and the recipe schema's defaults
(:class:`quantkit.recipe.EvaluationSpec`). Perplexity alone can hide a broken artifact (a model that is confidently
different from its source can still score the text well), which is why KLD and top-1 gate too.

A figure that is missing or not finite (NaN logits) fails the gate that checks it. Tested with pydantic 2.14.4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from quantkit.errors import GateFailedError, UsageError
from quantkit.recipe import GateSpec, EvaluationSpec

# gate name -> (metric it reads, comparison that passes)
GATES: dict[str, tuple[str, str]] = {
    "max_ppl_ratio": ("ppl_ratio", "<="),
    "max_kld": ("kld", "<="),
    "min_top1": ("top1", ">="),
}


@dataclass
class GateResult:
    """One gate checked against one result."""

    gate: str
    metric: str
    value: float | None
    limit: float
    passed: bool

    def describe(self) -> str:
        op = GATES[self.gate][1]
        shown = "not measured" if self.value is None else f"{self.value:.4g}"
        verdict = "ok" if self.passed else "FAILED"
        return f"{self.gate}: {self.metric} {shown} (limit {op} {self.limit:g}) {verdict}"

    def to_json(self) -> dict[str, Any]:
        return {"gate": self.gate, "metric": self.metric, "value": self.value, "limit": self.limit,
                "passed": self.passed}


def resolve(flags: dict[str, float | None], *layers: GateSpec | dict[str, Any] | None) -> GateSpec:
    """Merge gate limits: ``flags`` over the first layer that is set, over the schema's defaults."""
    base: dict[str, Any] = EvaluationSpec().gates.model_dump()
    for layer in reversed([x for x in layers if x is not None]):
        base.update(layer.model_dump() if isinstance(layer, GateSpec) else layer)
    base.update({k: v for k, v in flags.items() if v is not None})
    try:
        return GateSpec.model_validate(base)
    except ValidationError as e:
        problems = "; ".join(f"--{'-'.join(str(p) for p in err['loc']).replace('_', '-')}: "
                             f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        raise UsageError(f"invalid gate limit: {problems}") from None


def check(figures: dict[str, float | None], gates: GateSpec) -> list[GateResult]:
    """Each gate that is set, checked against ``figures`` (keys ``ppl_ratio``, ``kld``, ``top1``)."""
    out = []
    for gate, (metric, op) in GATES.items():
        limit = getattr(gates, gate)
        if limit is None:
            continue
        value = figures.get(metric)
        ok = value is not None and math.isfinite(value) and (value <= limit if op == "<=" else value >= limit)
        out.append(GateResult(gate=gate, metric=metric, value=value, limit=limit, passed=ok))
    return out


def enforce(failed: dict[str, list[GateResult]]) -> None:
    """Raise :class:`GateFailedError` (exit 3) naming every failed gate, its value and its limit, per artifact."""
    failed = {label: [g for g in gs if not g.passed] for label, gs in failed.items()}
    failed = {label: gs for label, gs in failed.items() if gs}
    if not failed:
        return
    lines = [f"{label}: " + "; ".join(g.describe() for g in gs) for label, gs in failed.items()]
    raise GateFailedError(
        f"{sum(len(g) for g in failed.values())} gate(s) failed:\n  " + "\n  ".join(lines),
        hint="the artifact differs from its baseline more than the gates allow; the full figures are in the report")
