"""The shape every producer shares: estimate the output size, then produce into a folder.

A producer writes files into ``ctx.workdir``: the temporary folder :class:`~quantkit.artifact.ArtifactWriter` owns,
which is renamed to the output only once the artifact is complete (so a producer never sees the final path). It
returns what the manifest should say about the quantization. It never evaluates (that is
:mod:`quantkit.evaluation`'s job) and never renames or hashes (that is :mod:`quantkit.artifact`'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from quantkit.calibration import CalibrationSet, Documents
from quantkit.progress import Reporter
from quantkit.recipe import CalibrationSpec, ModelSpec, RuntimeSpec
from quantkit.source import SourceModel


@dataclass
class ProduceContext:
    """Everything a producer needs for one output."""

    spec: Any  # one of the recipe's method specs (AwqSpec, GgufSpec, ...)
    source: SourceModel
    model: ModelSpec  # how to load the source: dtype, trust_remote_code
    workdir: Path  # the temporary folder the artifact is written into (renamed to the output when complete)
    calibration: CalibrationSpec
    runtime: RuntimeSpec
    reporter: Reporter
    checked: Any = None  # what the producer's check decided from the source (Producer.check), so it is decided once
    # the calibration's documents where the build read them before the producer started (a hub dataset, whose repeats
    # are said before the work: quantkit.api.quantize_one), handed on so they are not read again; None: read here
    documents: Documents | None = None
    _calib_cache: dict = field(default_factory=dict)

    def calibration_set(self, tokenizer: Any) -> CalibrationSet:
        """The calibration samples for this run, built once per context and reused, from :attr:`documents` where
        the build read them already."""
        from quantkit import calibration

        if "set" not in self._calib_cache:
            with self.reporter.step("calibration_data", f"Tokenizing calibration set {self.calibration.dataset!r}"):
                self._calib_cache["set"] = calibration.build(self.calibration, tokenizer, self.documents)
        return self._calib_cache["set"]


@dataclass
class Produced:
    """What a producer made: the manifest's ``quantization`` section, the calibration it used, and notes (the
    artifact's format is its registry row's kind, not the producer's to say)."""

    quantization: dict[str, Any]
    calibration: CalibrationSet | None = None
    notes: list[str] = field(default_factory=list)


class Producer(Protocol):
    """One per format family (compressed-tensors, GGUF, TensorRT-LLM)."""

    def check(self, spec: Any, source: SourceModel) -> Any:
        """Refuse early (before loading weights) what this producer cannot do for this source; returns what it
        decided from the source unasked (None where nothing), which the build hands to :meth:`produce` as
        ``ctx.checked`` (:func:`quantkit.plan.prepare`)."""

    def estimate_bytes(self, spec: Any, source: SourceModel) -> int:
        """Roughly how many bytes the artifact will take. A producer that also writes files it removes before it
        returns (GGUF's 16-bit intermediate) says how many with ``working_bytes(spec, source)``; the free-space
        check and the plan ask for both (:func:`quantkit.plan.disk_need`)."""

    def produce(self, ctx: ProduceContext) -> Produced:
        """Write the artifact's files into ``ctx.workdir``."""
