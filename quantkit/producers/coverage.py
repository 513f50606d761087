"""After quantizing, before saving: did every module that should be quantized come out quantized, with usable scales?

The field's most common silent failure is a checkpoint that loads and runs but left part of the model in full
precision (experts stored as fused 3-D tensors that no ``Linear`` target matched, an ignore pattern broader than
meant) or quantized with NaN or zero scales (an expert no calibration token reached). llm-compressor reports
neither. This check counts, on the model as oneshot left it:

* every ``nn.Linear`` the recipe targets and does not ignore must carry a weight quantization scheme and finite,
  positive scales (FP4's global scales included);
* for a mixture-of-experts family quantkit knows (:mod:`quantkit.producers.moe`), every expert projection of every
  MoE layer must, whatever the ignore list says: the experts are most of the weights and the point of quantizing;
* no module the ignore list names (routers, ``lm_head``) may have been quantized;
* in a mix of schemes (a bits target: int4 with int8, FP4 with int8 or FP8), every module's scales must be its own
  scheme's: one per group of its group size along the input (one per output channel for a per-channel scheme), and
  a global scale exactly where its strategy has one (NVFP4's tensor groups), so a module quantized under the other
  group's arguments cannot pass.

A failure is a :class:`~quantkit.errors.BackendError` (exit 1) naming the modules, raised inside the producer, so the
artifact writer removes the temporary folder and nothing is published.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import BackendError
from quantkit.producers import moe

_SHOWN = 6  # modules named in a message before "(+N more)"


@dataclass
class Coverage:
    """What the check found. ``experts`` is per MoE layer: how many expert projections it has and which were not
    quantized (``E.proj``); None for a dense model."""

    expected: int = 0
    quantized: int = 0
    missing: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    bad_scales: list[str] = field(default_factory=list)
    wrong_scales: list[str] = field(default_factory=list)
    ignored_but_quantized: list[str] = field(default_factory=list)
    caught_by: dict[str, str] = field(default_factory=dict)
    experts: dict[int, dict[str, Any]] | None = None

    @property
    def ok(self) -> bool:
        return not (self.missing or self.absent or self.bad_scales or self.wrong_scales or self.ignored_but_quantized)

    def manifest(self) -> dict[str, Any]:
        """The manifest's compact record (module lists only where something failed, which then never publishes)."""
        out: dict[str, Any] = {"expected": self.expected, "quantized": self.quantized}
        if self.experts is not None:
            out["expert_projections"] = sum(v["expected"] for v in self.experts.values())
            out["expert_layers"] = len(self.experts)
        return out

    def raise_for_failures(self) -> None:
        """Raise the error a user sees, naming the modules (first few and how many)."""
        if self.ok:
            return
        parts, hints = [], []
        if self.missing or self.absent:
            n = len(self.missing) + len(self.absent)
            parts.append(f"{n} of {self.expected} modules that must be quantized were not: "
                         + _names(self.missing + self.absent))
        if self.experts and any(v["missing"] for v in self.experts.values()):
            parts.append("experts not quantized, per layer: " + "; ".join(
                f"layer {i}: {_names(v['missing'], 8)}" for i, v in self.experts.items() if v["missing"]))
        if self.caught_by:
            patterns = sorted(set(self.caught_by.values()))
            hints.append(f"the ignore list catches them ({', '.join(patterns)}); every expert of an MoE "
                         "must be quantized: narrow or drop those patterns (quantize.ignore / --ignore)")
        if self.absent:
            hints.append("some modules do not exist as Linear layers: their experts were not linearized by "
                         "llm-compressor (an MoE layout it does not know)")
        if self.bad_scales:
            parts.append(f"{len(self.bad_scales)} modules have NaN, infinite or zero scales: {_names(self.bad_scales)}")
            hints.append("scales like these come from modules calibration never reached: use more calibration data")
        if self.wrong_scales:
            parts.append(f"{len(self.wrong_scales)} modules of a mix carry scales other than their scheme's: "
                         f"{_names(self.wrong_scales)}")
        if self.ignored_but_quantized:
            parts.append(f"{len(self.ignored_but_quantized)} modules the ignore list names were quantized: "
                         f"{_names(self.ignored_but_quantized)}")
        if not hints:
            hints.append("LLM_COMPRESSOR_LOG_LEVEL=INFO shows what llm-compressor did; rerun with --debug")
        raise BackendError("quantization left the model incomplete, nothing was written: " + "; ".join(parts),
                           hint="; ".join(hints))


def _names(names: list[str], shown: int = _SHOWN) -> str:
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _quantized(module: Any) -> bool:
    scheme = getattr(module, "quantization_scheme", None)
    return scheme is not None and getattr(scheme, "weights", None) is not None and hasattr(module, "weight_scale")


# Every scale a quantized Linear may carry: its weight's and its input's, and FP4's per-tensor global scales (NVFP4:
# weight_global_scale, and input_global_scale with FP4 activations). Before saving they are floats whatever the
# format stores (NVFP4's FP8 E4M3 and MXFP4's E8M0 power-of-two group scales are bf16 in memory, their values exact),
# so one test covers them: finite and positive.
_SCALES = ("weight_scale", "input_scale", "weight_global_scale", "input_global_scale")


def _scales_ok(module: Any, signed: bool = False) -> bool:
    import torch

    for name in _SCALES:
        scale = getattr(module, name, None)
        if scale is not None and not (torch.isfinite(scale).all() and ((scale != 0) if signed else (scale > 0)).all()):
            return False
    return True


def _scheme_key(module: Any) -> tuple[Any, ...]:
    """What sets a module's weight scales apart: its scheme's type, bits, strategy and group size."""
    w = module.quantization_scheme.weights
    return str(w.type), w.num_bits, str(w.strategy), w.group_size


def _scales_fit(module: Any) -> bool:
    """Whether a module's weight scales are its scheme's: ``weight_scale`` one per group of its size along the input
    (group and tensor-group strategies) or one per output channel (channel), and ``weight_global_scale`` exactly
    where the strategy is tensor-group (NVFP4). Other strategies (tensor, block) are not checked here."""
    from compressed_tensors.quantization import QuantizationStrategy

    w = module.quantization_scheme.weights
    out_features, in_features = module.weight.shape
    expected = {QuantizationStrategy.GROUP: (out_features, in_features // (w.group_size or 1)),
                QuantizationStrategy.TENSOR_GROUP: (out_features, in_features // (w.group_size or 1)),
                QuantizationStrategy.CHANNEL: (out_features, 1)}.get(w.strategy)
    if expected is not None and tuple(module.weight_scale.shape) != expected:
        return False
    return hasattr(module, "weight_global_scale") == (w.strategy == QuantizationStrategy.TENSOR_GROUP)


def check(model: Any, ignore: list[str], config: dict[str, Any], signed_scales: bool = False) -> Coverage:
    """Count what oneshot quantized in ``model`` against what ``ignore`` and the MoE family say it must.

    ``signed_scales``: a scale may be negative, only zero or non-finite fails. AutoRound's symmetric scales carry
    the sign of each group's largest-magnitude weight, so that weight lands on -2^(bits-1), the code a positive
    scale never uses (auto-round 0.15.1's ``quant_tensor_sym``, "full range")."""
    import torch
    from compressed_tensors.utils import is_match

    modules = dict(model.named_modules())
    fam = moe.family(config)
    experts = moe.expert_modules(fam, config, moe.layer_prefix(model)) if fam else {}
    expert_names = {name for names in experts.values() for name in names}
    cov = Coverage()
    must = [n for n, m in modules.items()
            if isinstance(m, torch.nn.Linear) and n not in expert_names and not is_match(n, m, ignore)]
    must += sorted(expert_names)
    cov.expected = len(must)
    for name in must:
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            cov.absent.append(name)
        elif not _quantized(module):
            cov.missing.append(name)
            caught = next((p for p in ignore if is_match(name, module, p)), None)
            if caught is not None:
                cov.caught_by[name] = caught
        else:
            cov.quantized += 1
            if not _scales_ok(module, signed_scales):
                cov.bad_scales.append(name)
    quantized = [modules[n] for n in must if isinstance(modules.get(n), torch.nn.Linear) and _quantized(modules[n])]
    if len({_scheme_key(m) for m in quantized}) > 1:
        cov.wrong_scales = [n for n in must if modules.get(n) in quantized and not _scales_fit(modules[n])]
    cov.ignored_but_quantized = [n for n, m in modules.items()
                                 if n not in expert_names and is_match(n, m, ignore) and _quantized(m)]
    if fam:
        failed = set(cov.missing) | set(cov.absent)
        cov.experts = {i: {"expected": len(names),
                           "missing": [n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in names if n in failed]}
                       for i, names in experts.items()}
    return cov
