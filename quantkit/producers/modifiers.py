"""The spec-to-modifier plan: each recipe spec, through one declarative table (:data:`_PLANS`, read by :func:`plan`),
as the llm-compressor modifiers that make it, with the summary the manifest records.

A plan is plain data (class names and keyword arguments) until :meth:`Plan.build` imports llm-compressor, so planning
and its tests load no backend. Every algorithm is llm-compressor's; quantkit only chooses the arguments.

Tested with llmcompressor 0.14.0.1 and compressed-tensors 0.19.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import UsageError
from quantkit.formats.names import Method
from quantkit.formats.specs import DEFAULT_GROUP_SIZE
from quantkit.producers import mixed

# Where each modifier named in a plan lives (imported only when a plan is built into objects).
_MODIFIERS = {
    "AWQModifier": "llmcompressor.modifiers.transform",
    "SmoothQuantModifier": "llmcompressor.modifiers.transform",
    "GPTQModifier": "llmcompressor.modifiers.gptq",
    "AutoRoundModifier": "llmcompressor.modifiers.autoround",
    "QuantizationModifier": "llmcompressor.modifiers.quantization",
}
# Modifiers that quantize (and so take the recipe's targets and ignore list); the others transform weights.
_QUANTIZERS = ("GPTQModifier", "QuantizationModifier", "AutoRoundModifier")
# Modifiers that leave the weights as loaded until compression (they only observe them).
_OBSERVES_ONLY = ("QuantizationModifier",)
_FP8_PRESETS = {"static": "FP8", "dynamic": "FP8_DYNAMIC", "block": "FP8_BLOCK"}
_FP8_KV_CACHE = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# compressed-tensors 0.19's FP4 presets, by method and scheme (quantization/quant_scheme.py), and llm-compressor
# 0.14's observer names for the FP4 weight scales (weights are observed once, so the memoryless ones).
_FP4_PRESETS = {(Method.NVFP4, "w4a16"): "NVFP4A16", (Method.NVFP4, "w4a4"): "NVFP4",
                (Method.MXFP4, "w4a16"): "MXFP4A16", (Method.MXFP4, "w4a4"): "MXFP4"}
_FP4_OBSERVERS = {"minmax": "memoryless_minmax", "mse": "memoryless_mse"}
# What each FP4 format stores besides its E2M1 values (the manifest's summary; compressed-tensors' NVFP4 and MXFP4
# compressors, mx_utils for E8M0), and the activations each scheme leaves.
_FP4_SCALES = {Method.NVFP4: "fp8 e4m3 per group + fp32 global scale per tensor",
               Method.MXFP4: "e8m0 (power of two) per group"}
_FP4_ACTIVATIONS = {Method.NVFP4: "fp4 e2m1 groups of 16, fp8 e4m3 scales computed at run time under a calibrated fp32 "
                                   "global scale (input_global_scale)",
                    Method.MXFP4: "fp4 e2m1 groups of 32, e8m0 scales computed at run time"}


@dataclass(frozen=True)
class Plan:
    """What one spec asks llm-compressor to do: modifiers as (class name, keyword arguments), in order."""

    scheme: str
    modifiers: tuple[tuple[str, dict[str, Any]], ...]
    calibrate: bool
    summary: dict[str, Any] = field(default_factory=dict)
    save_format: str | None = None  # the compressed-tensors format to write, when its own inference is wrong
    signed_scales: bool = False  # scales may be negative (AutoRound's full-range symmetric int), see coverage.check

    @property
    def rewrites_weights(self) -> bool:
        """Whether a modifier writes new weights into the model while it calibrates (GPTQ, AWQ's and SmoothQuant's
        smoothing, AutoRound), so that the process holds a copy of every weight it allocated itself; the
        QuantizationModifier only observes them, leaving them where the load mapped them from the source's files.
        :func:`quantkit.plan._memory` counts the host memory by it."""
        return any(name not in _OBSERVES_ONLY for name, _ in self.modifiers)

    def build(self, ignore: list[str]) -> list[Any]:
        """The llm-compressor modifier objects (imports llm-compressor)."""
        import importlib

        out = []
        for name, kwargs in self.modifiers:
            cls = getattr(importlib.import_module(_MODIFIERS[name]), name)
            extra = {"targets": ["Linear"], "ignore": list(ignore)} if name in _QUANTIZERS else {}
            out.append(cls(**kwargs, **extra))
        return out

    def recipe(self, ignore: list[str]) -> list[dict[str, Any]]:
        """The plan as plain data (recorded in the manifest; the same recipe can be run through oneshot)."""
        return [{name: {**kwargs, **({"targets": ["Linear"], "ignore": list(ignore)} if name in _QUANTIZERS
                                     else {})}} for name, kwargs in self.modifiers]


def _int_weights(bits: int, group_size: int, symmetric: bool) -> dict[str, Any]:
    """Integer weight-only quantization args; group_size -1 is one scale per output channel."""
    grouped = group_size > 0
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
            "strategy": "group" if grouped else "channel", "group_size": group_size if grouped else None}


def _int_scheme(bits: int, symmetric: bool, split: dict[int, list[str]] | None = None) -> str:
    """The compressed-tensors preset name (``W4A16``), or the mix a bits plan makes (``W4A16+W8A16``)."""
    widths = sorted(b for b, names in split.items() if names) if split else [bits]
    asym = [not symmetric and not (split and b == mixed.HIGH_BITS and mixed.HIGH_SYMMETRIC) for b in widths]
    return "+".join(f"W{b}A16" + ("_ASYM" if a else "") for b, a in zip(widths, asym))


def _group(spec: Any) -> int:
    """The spec's group size, an unset one read as the default: the compressed producer resolves it against the
    source (:func:`quantkit.producers.groups.group_choice`) before planning, so only a plan made without a source
    reads this."""
    return DEFAULT_GROUP_SIZE if spec.group_size is None else spec.group_size


def _weight_only(spec: Any, observer: str | None = None, split: dict[int, list[str]] | None = None) -> dict[str, Any]:
    """One config group for every Linear, or with a bits plan (``split``: bits -> its modules' targets, from
    :func:`quantkit.producers.mixed.targets`) one group per precision."""
    def weights(bits: int) -> dict[str, Any]:
        symmetric = spec.symmetric or (split is not None and bits == mixed.HIGH_BITS and mixed.HIGH_SYMMETRIC)
        return _int_weights(bits, _group(spec), symmetric) | ({"observer": observer} if observer else {})

    if split is None:
        return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights(spec.bits)}}}
    return {"config_groups": {f"group_{i}": {"targets": names, "weights": weights(bits)}
                              for i, (bits, names) in enumerate(sorted(split.items())) if names}}


def _int_summary(spec: Any) -> dict[str, Any]:
    g = _group(spec)
    return {"bits": spec.bits, "group_size": g, "symmetric": spec.symmetric,
            "weights": f"int{spec.bits} {'per-channel' if g < 0 else f'group {g}'}"
                       f" {'symmetric' if spec.symmetric else 'asymmetric'}",
            "activations": "bf16/fp16 (weight-only)"}


def _awq_smoothing(duo_scaling: bool, offload: bool) -> tuple[str, dict[str, Any]]:
    """AWQ's smoothing step, for ``awq`` and ``gptq --awq``. Offloading is always said, so llm-compressor's MoE-only
    default never decides silently. Offloading moves the same tensors, so the scales do not change; on the 8B shape
    it saved 16% of the GPU memory for 66% more time (bench/results/h200/8b/quantize_cost_8b_sealed.md), hence off
    unless asked."""
    return "AWQModifier", {"duo_scaling": duo_scaling, "offload_device": "cpu" if offload else None}


def _plan_awq(spec: Any, split: dict[int, list[str]] | None = None) -> Plan:
    return Plan(_int_scheme(spec.bits, spec.symmetric, split),
                (_awq_smoothing(spec.duo_scaling, spec.offload_activations),
                 ("QuantizationModifier", _weight_only(spec, split=split))),
                calibrate=True, summary={**_int_summary(spec), "algorithm": "awq", "duo_scaling": spec.duo_scaling,
                                         "offload_activations": spec.offload_activations})


def _plan_gptq(spec: Any, split: dict[int, list[str]] | None = None) -> Plan:
    # llm-compressor 0.14 offers only "static" (weight) activation ordering: columns are quantized by decreasing
    # activation magnitude but groups stay contiguous, so the layout and kernels are unchanged (no g_idx).
    # The importance-weighted observer (llmcompressor.observers.imatrix) gathers each input channel's mean squared
    # activation through its own hook during GPTQ's calibration pass, then grid-searches each group's range against
    # the error weighted by it; GPTQ rounds inside that range as before.
    # With ``awq`` AWQ's smoothing runs first, as in llm-compressor's AWQ-then-GPTQ example: its scales move into
    # the preceding norms and layers, and GPTQ then quantizes the smoothed weights (AWQ's own search scores its
    # scales under round-to-nearest of the same scheme, so both see one quantization).
    actorder = "static" if spec.act_order else None
    observer = "imatrix_mse" if spec.imatrix else None
    smooth = (_awq_smoothing(duo_scaling=True, offload=False),) if spec.awq else ()
    return Plan(_int_scheme(spec.bits, spec.symmetric, split),
                (*smooth, ("GPTQModifier", {**_weight_only(spec, observer, split), "dampening_frac": spec.damp,
                                            "actorder": actorder})),
                calibrate=True, summary={**_int_summary(spec), "algorithm": "awq+gptq" if spec.awq else "gptq",
                                         "damp": spec.damp, "actorder": actorder,
                                         "observer": observer or "memoryless_minmax"})


def _plan_autoround(spec: Any) -> Plan:
    # llm-compressor's sequential pipeline hands AutoRound one decoder layer at a time with the inputs it captured;
    # torch.compile is decided when the plan runs (:func:`quantkit.producers.oneshot.run`), since it helps only on an
    # accelerator.
    return Plan(_int_scheme(spec.bits, spec.symmetric),
                (("AutoRoundModifier", {**_weight_only(spec), "iters": spec.iterations,
                                        "batch_size": spec.batch_size, "lr": spec.lr}),),
                calibrate=True, summary={**_int_summary(spec), "algorithm": "autoround",
                                         "iterations": spec.iterations, "batch_size": spec.batch_size,
                                         "lr": spec.lr if spec.lr is not None else 1 / spec.iterations},
                signed_scales=True)


def autoround_batch(spec: Any, samples: int) -> Any:
    """The AutoRound spec with the batch it runs on ``samples`` calibration samples (another method's unchanged).

    AutoRound draws each tuning step's batch from the samples and runs at most all of them (auto-round 0.15:
    ``batch_size = min(batch_size, nsamples)``), silently, so a manifest would record a batch that never ran. A
    ``--batch-size`` given larger than ``--samples`` is refused (exit 2): the user asked for something that cannot
    happen. The default 8 with fewer samples is lowered to them, which is what runs, and what the manifest says."""
    if spec.method != Method.AUTOROUND or spec.batch_size <= samples:
        return spec
    if "batch_size" in spec.model_fields_set:
        raise UsageError(f"--batch-size {spec.batch_size} is more than the {samples} calibration samples AutoRound "
                         "tunes on: each step's batch is drawn from them",
                         hint=f"give --batch-size {samples} or less, or --samples {spec.batch_size} or more")
    return spec.model_copy(update={"batch_size": samples})


def _plan_rtn(spec: Any, split: dict[int, list[str]] | None = None) -> Plan:
    return Plan(_int_scheme(spec.bits, spec.symmetric, split),
                (("QuantizationModifier", _weight_only(spec, split=split)),),
                calibrate=spec.target_bits is not None, summary={**_int_summary(spec), "algorithm": "rtn"})


def _plan_fp8(spec: Any) -> Plan:
    preset = _FP8_PRESETS[spec.scheme]
    kwargs: dict[str, Any] = {"scheme": preset}
    if spec.kv_cache_fp8:
        kwargs["kv_cache_scheme"] = dict(_FP8_KV_CACHE)
    weights, acts = {
        "static": ("fp8 e4m3 per-tensor", "fp8 e4m3 static per-tensor (calibrated input_scale)"),
        "dynamic": ("fp8 e4m3 per-channel", "fp8 e4m3 dynamic per-token"),
        "block": ("fp8 e4m3 128x128 blocks", "fp8 e4m3 dynamic per-token groups of 128"),
    }[spec.scheme]
    return Plan(preset, (("QuantizationModifier", kwargs),), calibrate=spec.scheme == "static" or spec.kv_cache_fp8,
                summary={"algorithm": f"fp8-{spec.scheme}", "bits": 8, "group_size": None, "symmetric": True,
                         "weights": weights, "activations": acts, "kv_cache": "fp8" if spec.kv_cache_fp8 else None})


def _plan_int8(spec: Any) -> Plan:
    weights = ("GPTQModifier", {"scheme": "W8A8"}) if spec.weights == "gptq" \
        else ("QuantizationModifier", {"scheme": "W8A8"})
    return Plan("W8A8", (("SmoothQuantModifier", {"smoothing_strength": spec.smoothing_strength}), weights),
                calibrate=True,
                summary={"algorithm": f"smoothquant+{spec.weights}", "bits": 8, "group_size": -1, "symmetric": True,
                         "smoothing_strength": spec.smoothing_strength, "weights": "int8 per-channel symmetric",
                         "activations": "int8 dynamic per-token symmetric"})


def _plan_w4a8(spec: Any) -> Plan:
    # compressed-tensors 0.19 infers int-quantized (one int4 value per byte) for float-activation schemes, but
    # vLLM's CompressedTensorsW4A8Fp8 reads pack-quantized (eight int4 values per int32): ask for that.
    modifier = "GPTQModifier" if spec.weights == "gptq" else "QuantizationModifier"
    return Plan("W4AFP8", ((modifier, {"scheme": "W4AFP8"}),), calibrate=spec.weights == "gptq",
                summary={"algorithm": f"w4a8+{spec.weights}", "bits": 4, "group_size": 128, "symmetric": True,
                         "weights": "int4 group 128 symmetric", "activations": "fp8 e4m3 dynamic per-token"},
                save_format="pack-quantized")


def _fp4_groups(spec: Any, split: dict[int, list[str]]) -> dict[str, Any]:
    """The config groups of an FP4 bits plan (``split``: bits -> targets): the FP4 preset's arguments with the spec's
    observer on its weights for the 4-bit layers, the 8-bit layers' as :data:`quantkit.producers.mixed.FP4_HIGH`
    says (FP8-dynamic's preset, or int8 weight-only per channel), in one modifier so GPTQ and AWQ see both. Read from
    compressed-tensors' presets when the plan is made (the model is loaded by then), so no argument is copied."""
    from compressed_tensors.quantization import preset_name_to_scheme

    def preset(name: str, targets: list[str]) -> dict[str, Any]:
        return preset_name_to_scheme(name, targets).model_dump(mode="json", exclude_none=True)

    _, high = mixed.precisions(spec)
    groups = []
    if split[mixed.LOW_BITS]:
        low = preset(_FP4_PRESETS[spec.method, spec.scheme], split[mixed.LOW_BITS])
        low["weights"]["observer"] = _FP4_OBSERVERS[spec.weight_observer]
        groups.append(low)
    if split[mixed.HIGH_BITS]:
        raised = split[mixed.HIGH_BITS]
        groups.append(preset(high.preset, raised) if high.preset else
                      {"targets": raised, "weights": _int_weights(high.bits, high.group_size, True)})
    return {"config_groups": {f"group_{i}": g for i, g in enumerate(groups)}}


def _fp4_scheme(spec: Any, split: dict[int, list[str]] | None) -> str:
    """The preset's name, or a bits plan's mix (``NVFP4A16+FP8_DYNAMIC``, ``MXFP4A16+W8A16``)."""
    preset = _FP4_PRESETS[spec.method, spec.scheme]
    if split is None or not split[mixed.HIGH_BITS]:
        return preset
    _, high = mixed.precisions(spec)
    return f"{preset}+{high.preset or _int_scheme(high.bits, True)}"


def _plan_fp4(spec: Any, split: dict[int, list[str]] | None = None) -> Plan:
    # NVFP4 and MXFP4 through compressed-tensors' presets. GPTQ takes the FP4 scheme itself (its column updates
    # quantize each group under the observer's scale; NVFP4's global scale comes first from the whole weight); AWQ
    # smooths with round-to-nearest of the same scheme in its grid search (llm-compressor's AWQ+NVFP4 example), then
    # the QuantizationModifier rounds the smoothed weights. compressed-tensors 0.19 infers nvfp4-pack-quantized for
    # FP4 groups of 16 and mxfp4-pack-quantized for 32, what vLLM 0.26 reads, so no save format is forced; a bits
    # plan's checkpoint is mixed-precision, each config group with its own format.
    preset = _FP4_PRESETS[spec.method, spec.scheme]
    quantize: dict[str, Any] = ({"scheme": preset, "weight_observer": _FP4_OBSERVERS[spec.weight_observer]}
                                if split is None else _fp4_groups(spec, split))
    if spec.algorithm == "gptq":
        modifiers: tuple[tuple[str, dict[str, Any]], ...] = (
            ("GPTQModifier", {**quantize, "dampening_frac": 0.01, "actorder": "static"}),)
    elif spec.algorithm == "awq":
        modifiers = (_awq_smoothing(duo_scaling=True, offload=False), ("QuantizationModifier", quantize))
    else:
        modifiers = (("QuantizationModifier", quantize),)
    return Plan(_fp4_scheme(spec, split), modifiers, calibrate=spec.calibrates,
                summary={"algorithm": spec.algorithm, "observer": _FP4_OBSERVERS[spec.weight_observer], "bits": 4,
                         "group_size": spec.group_size, "symmetric": True, "fp4_scheme": spec.scheme,
                         "weights": f"fp4 e2m1 group {spec.group_size}", "scales": _FP4_SCALES[spec.method],
                         "activations": _FP4_ACTIVATIONS[spec.method] if spec.scheme == "w4a4"
                         else "bf16/fp16 (weight-only)",
                         **({"high": mixed.precisions(spec)[1].words} if spec.target_bits is not None else {})})


_PLANS = {Method.AWQ: _plan_awq, Method.GPTQ: _plan_gptq, Method.AUTOROUND: _plan_autoround, Method.RTN: _plan_rtn,
          Method.FP8: _plan_fp8, Method.INT8: _plan_int8, Method.W4A8: _plan_w4a8, Method.NVFP4: _plan_fp4,
          Method.MXFP4: _plan_fp4}


def plan(spec: Any, split: dict[int, list[str]] | None = None) -> Plan:
    """The declarative table: a recipe spec -> the llm-compressor modifiers that produce it; ``split`` (bits -> the
    targets at those bits) for a spec with a bits target, once its plan is chosen (:mod:`quantkit.producers.mixed`)."""
    if split is not None:
        return _PLANS[spec.method](spec, split)
    return _PLANS[spec.method](spec)
