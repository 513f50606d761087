"""The public Python API: what the CLI, recipes, the pipeline and the tests all call.

    from quantkit import api, recipe
    r = recipe.load("recipes/awq.yaml", {"model.source": "models/quantkit-tiny", "output": "out/awq"})
    result = api.quantize(r)            # -> ArtifactResult, with the manifest as written

Each function takes plain values and returns plain results; printing is the CLI's job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit import artifact, producers, source as source_mod, versions
from quantkit.progress import Reporter
from quantkit.producers.base import ProduceContext
from quantkit.recipe import Recipe, dump


@dataclass
class ArtifactResult:
    """One artifact written: where, and its manifest."""

    path: Path
    manifest: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {"path": str(self.path), "format": m.get("format"), "method": m.get("method"),
                "size_bytes": sum(f["size"] for f in m.get("files", {}).values()), "timings": m.get("timings"),
                "quantization": m.get("quantization"), "calibration": m.get("calibration")}


def quantize_one(recipe: Recipe, spec: Any, out: Path, *, force: bool = False, reporter: Reporter | None = None,
                 source: source_mod.SourceModel | None = None) -> ArtifactResult:
    """Produce one output of a recipe into ``out`` (atomically, with its manifest)."""
    rep = reporter or Reporter(quiet=True)
    rep.timings = {}
    t0 = time.perf_counter()
    if source is None:
        with rep.timed("check_source"):
            source = source_mod.resolve(recipe.model)
    producer = producers.get(spec.method)
    producer.check(spec, source)
    with artifact.ArtifactWriter(out, force=force, expected_bytes=producer.estimate_bytes(spec, source)) as w:
        ctx = ProduceContext(spec=spec, source=source, out=w.path, calibration=recipe.calibration,
                             runtime=recipe.runtime, reporter=rep, model=recipe.model)
        produced = producer.produce(ctx)
        rep.timings["total"] = round(time.perf_counter() - t0, 3)
        manifest = {
            "format": produced.format,
            "method": spec.method,
            "params": spec.model_dump(mode="json"),
            "quantization": produced.quantization,
            "source": source.manifest(),
            "calibration": produced.calibration.manifest() if produced.calibration else None,
            "recipe": recipe.model_dump(mode="json"),
            "recipe_yaml": dump(recipe),
            "recipe_sha256": recipe.sha256(),
            "output_sha256": recipe.output_sha256(spec),
            "runtime": recipe.runtime.model_dump(mode="json"),
            "versions": versions.installed(),
            "timings": dict(rep.timings),
            "notes": produced.notes,
            "evaluation": None,
            "smoke": None,
        }
        written = w.commit(manifest)
    return ArtifactResult(path=out, manifest=written)


def quantize(recipe: Recipe, *, force: bool = False, reporter: Reporter | None = None) -> list[ArtifactResult]:
    """Produce every output of a recipe, in order (no evaluation: see :func:`run` for the whole pipeline)."""
    src = source_mod.resolve(recipe.model)
    return [quantize_one(recipe, spec, out, force=force, reporter=reporter, source=src)
            for spec, out in recipe.artifacts()]


def verify(path: Path, reporter: Reporter | None = None) -> artifact.VerifyResult:
    """Re-hash an artifact's files against its manifest."""
    return artifact.verify(Path(path))


def evaluate(artifacts: list[Path], baseline: str | None = None, options: Any = None,
             reporter: Reporter | None = None) -> Any:
    """Perplexity, KLD and top-1 of artifacts against their baseline (:mod:`quantkit.verify.evaluate`).

    Returns an ``EvalReport``; gates are checked and recorded, not raised: call ``report.raise_for_gates()``.
    """
    from quantkit.verify.evaluate import evaluate as _evaluate

    return _evaluate([Path(a) for a in artifacts], baseline, options, reporter)


def inspect(path: Path) -> dict[str, Any]:
    """What an artifact is: format, bits, scheme, size, compression vs the source, and its manifest check."""
    from quantkit.inspect import describe

    return describe(Path(path))


def smoke(path: Path, *, reporter: Reporter | None = None, **options: Any) -> Any:
    """Serve an artifact in its real engine and check it answers (see :class:`quantkit.smoke.SmokeOptions`
    for the keywords); returns a :class:`quantkit.smoke.SmokeResult` whose ``ok`` says whether every run passed."""
    from quantkit import smoke as smoke_mod

    return smoke_mod.run(Path(path), smoke_mod.SmokeOptions(**options), reporter)


def doctor(path: Path | None = None, *, engine: str = "auto", python: str | None = None,
           env: dict[str, str] | None = None) -> Any:
    """Versions of quantkit's backends and the engine's, and whether the engine can read ``path``
    (a :class:`quantkit.doctor.Report`)."""
    from quantkit import doctor as doctor_mod

    return doctor_mod.check(Path(path) if path is not None else None, engine, python=python, env=env)
