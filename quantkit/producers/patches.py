"""Context managers that patch llm-compressor internals for one oneshot call, each restoring what it replaced.

Each reaches into private code of llmcompressor 0.14.0.1 (:data:`WRITTEN_FOR`): an attribute renamed or a method
no longer called in another release would not fail but leave the patch doing nothing (AWQ crashing on CPU again, or
every AWQ mapping recorded as applied in no layer). So each checks the installed version when it applies and refuses
any other (exit 1) until it is re-read against that version's source and :data:`WRITTEN_FOR` moved; pyproject pins
the same version, so only a hand-installed llm-compressor meets the refusal. :data:`WRITTEN_FOR` is not read from
that pin on purpose: moving the pin must not vouch for patches nobody has re-read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from quantkit import versions
from quantkit.errors import BackendError

if TYPE_CHECKING:
    from quantkit.producers.modifiers import Plan

WRITTEN_FOR = "0.14.0.1"  # the llmcompressor release whose internals these patches were read from and tested with


def _check_version(patch: str) -> None:
    """Refuse to patch an llm-compressor these patches were not read against (see the module's docstring)."""
    installed = versions.version("llmcompressor")
    if installed != WRITTEN_FOR:
        raise BackendError(f"quantkit patches llm-compressor's {patch}, written for llmcompressor {WRITTEN_FOR}; "
                           f"{installed} is installed",
                           hint=f"pip install llmcompressor=={WRITTEN_FOR} (quantkit's pin), or re-check "
                                "quantkit/producers/patches.py against the installed version")


@contextlib.contextmanager
def awq_without_pin_memory(p: Plan) -> Iterator[None]:
    """Skip llm-compressor's pin_memory() for AWQ when there is no accelerator.

    llmcompressor 0.14.0.1's AWQModifier._apply_smoothing pins its cached activations
    (pipelines/cache.py, IntermediatesCache.pin_memory) to speed up host-to-GPU copies; with no accelerator,
    torch refuses ("Cannot access accelerator device when none is available") and AWQ crashes on CPU. Pinning
    is only an optimisation for those copies, so when no accelerator exists it is skipped, for this call only.
    """
    import torch

    if not any(name == "AWQModifier" for name, _ in p.modifiers) or torch.accelerator.is_available():
        yield
        return
    _check_version("IntermediatesCache.pin_memory")
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]


@contextlib.contextmanager
def awq_resolved(p: Plan) -> Iterator[list[str]]:
    """The smooth layers AWQ's mappings resolved to, by name, as llm-compressor found them.

    llmcompressor 0.14.0.1's AWQModifier resolves each mapping's patterns per layer in ``_set_resolved_mappings``
    and skips a layer whose shapes do not fit (``_check_layers_are_compatible``: with grouped-query attention,
    v_proj -> o_proj everywhere), then forgets the result when it finishes; its mappings alone would say every
    mapping was used. So that method's result is read as it is made, for this call only.
    """
    names: list[str] = []
    if not any(name == "AWQModifier" for name, _ in p.modifiers):
        yield names
        return
    _check_version("AWQModifier._set_resolved_mappings")
    from llmcompressor.modifiers.transform.awq import AWQModifier

    original = AWQModifier._set_resolved_mappings

    def recording(self: Any, model: Any) -> None:
        original(self, model)
        names.extend(r.smooth_name for r in self._resolved_mappings)

    AWQModifier._set_resolved_mappings = recording  # type: ignore[method-assign]
    try:
        yield names
    finally:
        AWQModifier._set_resolved_mappings = original  # type: ignore[method-assign]
