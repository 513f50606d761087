"""One compressed-tensors job: everything a run needs once the checks have passed, typed.

The in-process path (:mod:`quantkit.producers.compressed`) and every torchrun rank
(:mod:`quantkit.producers.torchrun`, which reads it back from JSON) run the same :class:`Job` through
:mod:`quantkit.producers.oneshot`, so the two paths cannot drift apart in what they are given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from quantkit import ignore as ignore_mod
from quantkit.recipe import MethodSpec

if TYPE_CHECKING:
    from quantkit.producers.base import ProduceContext


class Job(BaseModel):
    """What oneshot is run on and with, as plain data (a torchrun rank gets it as JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: MethodSpec  # the method spec as the group choice made it (its group size resolved against the source)
    source: str  # the source checkpoint's folder
    config: dict[str, Any]  # its config.json
    ignore: list[str]  # the modules kept in full precision (quantkit.ignore.effective)
    dtype: str  # the load dtype (the recipe's model.dtype)
    trust_remote_code: bool
    seq_len: int
    min_expert_tokens: int
    seed: int
    out: str  # the folder the artifact is written into
    samples: list[list[int]] | None = None  # the calibration token ids; None: the plan reads no data
    images: list[str] | None = None  # the image files of an image+text calibration

    @classmethod
    def of(cls, ctx: ProduceContext, spec: Any) -> Job:
        """The job of a produce context, for ``spec`` (the context's spec as the group choice made it); the
        calibration is added once it is built (``model_copy(update=...)``)."""
        return cls(spec=spec, source=str(ctx.source.path), config=ctx.source.config,
                   ignore=ignore_mod.effective(ctx.spec, ctx.source), dtype=ctx.model.dtype,
                   trust_remote_code=ctx.model.trust_remote_code, seq_len=ctx.calibration.seq_len,
                   min_expert_tokens=ctx.calibration.min_expert_tokens, seed=ctx.runtime.seed, out=str(ctx.workdir))
