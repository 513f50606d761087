"""llm-compressor: AWQ, GPTQ, AutoRound, FP8, INT8 SmoothQuant and round-to-nearest -> compressed-tensors
checkpoints.

Each recipe spec maps, through one declarative table (:func:`plan`), to the llm-compressor modifiers that make
it; the model is loaded with transformers, calibrated with quantkit's own token samples (passed to ``oneshot``
as a ``datasets.Dataset`` of ``input_ids``, never re-tokenized by llm-compressor), and saved with
``save_compressed=True`` so vLLM and transformers load it. quantkit adds the flags, the calibration set and its
hash, the progress and the manifest; every algorithm is llm-compressor's.

* AWQ smoothing mappings are not ours: llm-compressor picks them from the architecture (its registry, falling
  back to its Llama-style defaults), and the manifest records them with the number of modules each was applied to.
* Widths: an unset group size is 128, or the largest group size vLLM's kernels take that divides every layer's input
  width (:func:`group_choice`: 64 on SmolLM2's 576), said in one warning and recorded; for ``gptq --target-bits``
  with no group size or symmetry given, 32 with zero points (said and recorded too); a given one that does not
  divide, and FP8 blocks or W4A8 groups of 128 where 128 does not divide (:func:`_check_tiles`), are refused before
  anything loads.
* Memory: llm-compressor's sequential pipeline (inferred for AWQ, GPTQ, SmoothQuant and static FP8) keeps the
  model on the CPU and moves one decoder layer at a time to the GPU, so GPU memory is about one layer's weights
  plus the calibration activations; the CPU needs the whole model in its load dtype. RTN, FP8 dynamic and FP8
  block need no data and run layer by layer through the data-free pipeline.
* ``runtime.num_gpus > 1`` relaunches the same job under ``torchrun`` (llm-compressor's distributed oneshot:
  data-parallel calibration, weight-parallel GPTQ), see :func:`_distributed`.
* ``--format autoawq`` / ``--format gptq`` are their own registry rows, made by :mod:`quantkit.producers.legacy`
  on top of this producer's checkpoint.
* Mixture-of-experts models use llm-compressor's own MoE support: its linear experts replace transformers 5's fused
  3-D experts (one Linear per expert projection) right after loading, one block at a time, and
  ``moe_calibrate_all_experts`` runs every expert on every calibration token. Routers and shared-expert gates are
  never quantized; the real router's choices are counted per expert, and :mod:`quantkit.producers.moe` knows each family (see there).
* After quantizing, :mod:`quantkit.producers.coverage` checks that every module that should be quantized was (for
  an MoE, every expert projection of every layer) with finite, positive scales; otherwise the run fails (exit 1)
  and nothing is published.

Tested with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, auto-round 0.15.1, transformers 5.17.0, torch 2.13.0
(CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit import ignore as ignore_mod
from quantkit.errors import BackendError, SourceModelError, UsageError
from quantkit.formats.specs import (DEFAULT_GROUP_SIZE, FALLBACK_GROUP_SIZES, TARGET_BITS_GROUP_FROM,
                                    TARGET_BITS_GROUP_SIZE, W4A8_GROUP_SIZE)
from quantkit.architectures import text_config
from quantkit.producers import coverage, mixed, moe, vision
from quantkit.producers.base import ProduceContext, Produced
from quantkit.source import SourceModel

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
# Weights in files of at most 4 GB (transformers 5 writes one file up to 50 GB): what the hub's own checkpoints
# ship (Llama 3.1, Qwen3: 4-5 GB shards), each file resumable on its own, and a shard finished while the next is
# written is hashed and fsynced meanwhile (quantkit.seal) instead of all 9 GB of an 8B FP8 artifact at the end.
SHARD_SIZE = "4GB"
_FP8_PRESETS = {"static": "FP8", "dynamic": "FP8_DYNAMIC", "block": "FP8_BLOCK"}
_GROUPED = ("awq", "gptq", "rtn", "autoround")  # methods whose group size a recipe sets (or leaves to group_choice)
_FP8_KV_CACHE = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@dataclass(frozen=True)
class Plan:
    """What one spec asks llm-compressor to do: modifiers as (class name, keyword arguments), in order."""

    scheme: str
    modifiers: tuple[tuple[str, dict[str, Any]], ...]
    calibrate: bool
    summary: dict[str, Any] = field(default_factory=dict)
    save_format: str | None = None  # the compressed-tensors format to write, when its own inference is wrong
    signed_scales: bool = False  # scales may be negative (AutoRound's full-range symmetric int), see coverage.check

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
    """The spec's group size, an unset one read as the default: :meth:`CompressedProducer.produce` resolves it
    against the source (:func:`group_choice`) before planning, so only a plan made without a source reads this."""
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
    # torch.compile is decided when the plan runs (:func:`_oneshot`), since it helps only on an accelerator.
    return Plan(_int_scheme(spec.bits, spec.symmetric),
                (("AutoRoundModifier", {**_weight_only(spec), "iters": spec.iterations,
                                        "batch_size": spec.batch_size, "lr": spec.lr}),),
                calibrate=True, summary={**_int_summary(spec), "algorithm": "autoround",
                                         "iterations": spec.iterations, "batch_size": spec.batch_size,
                                         "lr": spec.lr if spec.lr is not None else 1 / spec.iterations},
                signed_scales=True)


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


_PLANS = {"awq": _plan_awq, "gptq": _plan_gptq, "autoround": _plan_autoround, "rtn": _plan_rtn, "fp8": _plan_fp8,
          "int8": _plan_int8, "w4a8": _plan_w4a8}


def plan(spec: Any, split: dict[int, list[str]] | None = None) -> Plan:
    """The declarative table: a recipe spec -> the llm-compressor modifiers that produce it; ``split`` (bits -> the
    targets at those bits) for a spec with a bits target, once its plan is chosen (:mod:`quantkit.producers.mixed`)."""
    if split is not None:
        return _PLANS[spec.method](spec, split)
    return _PLANS[spec.method](spec)


# ----------------------------------------------------------------------------------------------------------------
# Checks before anything loads


def input_widths(config: dict[str, Any]) -> dict[str, int]:
    """The input widths of the Linear layers that get quantized, each named by the config keys that set it: a weight
    group runs along a layer's input, so every one of these must be a whole number of groups."""
    cfg = config.get("text_config") or config
    ints = {k: v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)}
    dims = {k: ints[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                 "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank") if ints.get(k)}
    value_dim = "v_head_dim" if ints.get("v_head_dim") else "head_dim"  # multi-head latent attention: v_head_dim
    if ints.get(value_dim) and ints.get("num_attention_heads"):
        dims[f"num_attention_heads x {value_dim} (o_proj input)"] = ints[value_dim] * ints["num_attention_heads"]
    return dims


@dataclass(frozen=True)
class GroupChoice:
    """The weight group size a run uses: what the recipe or flags asked for (None: nothing, so the default), the
    size used, and why (for the one warning line and the manifest's quantization summary)."""

    requested: int | None
    size: int
    reason: str
    symmetric: bool | None = None  # decided with the size (a gptq bits target's default); None: the spec's own

    @property
    def changed(self) -> bool:
        """Whether quantkit chose other than the plain default 128 (then the user is told, and the notes say why)."""
        return self.requested is None and (self.size != DEFAULT_GROUP_SIZE or self.symmetric is not None)

    def apply(self, spec: Any) -> Any:
        """The spec as this choice makes it: what the plan, the checks and a torchrun worker use."""
        return spec.model_copy(update={"group_size": self.size,
                                       **({} if self.symmetric is None else {"symmetric": self.symmetric})})

    def manifest(self) -> dict[str, Any]:
        """The keys it adds to the manifest's ``quantization`` section."""
        return {"group_size": self.size, "group_size_requested": self.requested, "group_size_reason": self.reason}


def _bits_target_default(spec: Any) -> bool:
    """Whether a ``gptq --target-bits`` run left its int4 layout to quantkit (no symmetry given; :func:`group_choice`
    asks only when no group size was) with a target of :data:`~quantkit.formats.specs.TARGET_BITS_GROUP_FROM` bits
    or more. There int4 in groups of 32 with zero points (4.625 bits per weight by itself) leaves fewer groups to
    raise to int8 and still scores lower: at 5.53 bits on SmolLM2-135M, 47 of 120 groups at int8 and an exact KLD of 0.0293, against 66 and
    0.0370 at group 64 symmetric (bench/results/h200/bits_g32a/). At 5.0 bits the two were level, so lower targets
    keep the plain default."""
    return (spec.method == "gptq" and getattr(spec, "target_bits", None) is not None
            and "symmetric" not in spec.model_fields_set and spec.target_bits >= TARGET_BITS_GROUP_FROM)


def group_choice(spec: Any, source: SourceModel) -> GroupChoice | None:
    """The group size of an ``awq``/``gptq``/``rtn`` spec on this source (None for methods without one).

    An explicit group size that does not divide a layer's input width is refused (exit 2), since llm-compressor
    would quantize a ragged last group and vLLM would refuse the artifact only when loading it. An unset one is the
    default 128, or the largest group size vLLM's kernels take that divides every input width
    (:data:`quantkit.formats.specs.FALLBACK_GROUP_SIZES`), or -1 (one scale per output channel) when none does.
    One size for every layer, not one per layer: vLLM fuses q/k/v and gate/up into single layers that must share a
    scheme, the AutoAWQ and GPTQ layouts carry one group size, and a smaller group only adds accuracy (and 16 bits
    of scale per group: 0.25 instead of 0.125 bits per weight at 64).
    """
    if spec.method not in _GROUPED:
        return None
    widths = input_widths(source.config)

    def not_divided(g: int) -> list[str]:
        return [f"{k} = {v}" for k, v in widths.items() if g > 0 and v % g]

    g = spec.group_size
    if g is not None:
        if not_divided(g):
            raise UsageError(f"--group-size {g} does not divide the layers' input width ({', '.join(not_divided(g))})",
                             hint="choose a group size that divides them, or -1 for one scale per output channel")
        return GroupChoice(g, g, "given")
    if _bits_target_default(spec) and not not_divided(TARGET_BITS_GROUP_SIZE):
        return GroupChoice(None, TARGET_BITS_GROUP_SIZE,
                           f"a bits target: int4 in groups of {TARGET_BITS_GROUP_SIZE} with zero points, the lowest "
                           f"KLD quantkit has measured at equal bits (--group-size or --symmetric/--asymmetric "
                           f"chooses another)", symmetric=False)
    bad = not_divided(DEFAULT_GROUP_SIZE)
    if not bad:
        return GroupChoice(None, DEFAULT_GROUP_SIZE, "the default")
    fits = next((n for n in FALLBACK_GROUP_SIZES if not not_divided(n)), -1)
    pick = (f"{fits}, the largest group size vLLM's kernels take that divides every layer's input width" if fits > 0
            else "-1 (one scale per output channel): no group size vLLM's kernels take divides every layer's input "
                 "width")
    return GroupChoice(None, fits, f"the default group size {DEFAULT_GROUP_SIZE} does not divide {', '.join(bad)}; "
                                   f"using {pick}")


def _fused_output_widths(config: dict[str, Any]) -> dict[str, int]:
    """The output widths of the layers vLLM fuses (q/k/v into one qkv_proj, gate/up into one gate_up_proj) and of
    the others (o_proj and down_proj write hidden_size)."""
    cfg = config.get("text_config") or config
    hidden, heads = int(cfg.get("hidden_size") or 0), int(cfg.get("num_attention_heads") or 0)
    kv, inter = int(cfg.get("num_key_value_heads") or heads), int(cfg.get("intermediate_size") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    dims = {"hidden_size (o_proj and down_proj output)": hidden,
            "(num_attention_heads + 2 x num_key_value_heads) x head_dim (fused q/k/v output)":
                (heads + 2 * kv) * head_dim,
            "2 x intermediate_size (fused gate/up output)": 2 * inter}
    return {k: v for k, v in dims.items() if v}


def _check_tiles(spec: Any, source: SourceModel) -> None:
    """Refuse the two schemes whose tiles are fixed at 128 on widths 128 does not divide: there is no other size to
    choose, and vLLM would refuse the artifact only after loading it.

    * W4A8: llm-compressor's W4AFP8 scheme groups 128 weights, and vLLM 0.26's one W4A8 kernel on Hopper
      (``CutlassW4A8LinearKernel.can_implement``) takes group 128 with every layer's input and output width (per
      GPU) a multiple of 128.
    * FP8 block: 128x128 weight blocks with activations quantized in groups of 128 along each layer's input, and
      vLLM's block-scaled kernels need whole blocks along the input (compressed-tensors' ``initialize`` says so).
      The output rows may end in a partial block, so only the input widths are checked.
    """
    if spec.method == "w4a8":
        what = (f"w4a8 quantizes in groups of {W4A8_GROUP_SIZE} (the only size its scheme and vLLM's CUTLASS W4A8 "
                "kernel take)")
        widths = {**input_widths(source.config), **_fused_output_widths(source.config)}
        hint = "use awq, gptq or rtn (W4A16: they choose a group size that divides) or fp8"
    elif spec.method == "fp8" and spec.scheme == "block":
        what = "--scheme block quantizes in 128x128 weight blocks and activation groups of 128 along each layer's input"
        widths = input_widths(source.config)
        hint = "use --scheme dynamic (per-channel weights, per-token activations) or static: they take any width"
    else:
        return
    bad = [f"{k} = {v}" for k, v in widths.items() if v % 128]
    if bad:
        raise UsageError(f"{what}, and 128 does not divide the layers' width ({', '.join(bad)})", hint=hint)


def _check_target_bits(spec: Any, source: SourceModel, group_size: int) -> None:
    """Refuse a bits target quantkit cannot plan here, before anything loads: on a mixture-of-experts model (vLLM's
    fused MoE layers take one scheme for all experts of a layer, and the expert weights are most of the model), or
    one outside what int4 and int8 layers mix to."""
    if moe.family(source.config):
        raise UsageError(f"--target-bits plans dense layers; {source.spec} is a mixture-of-experts model",
                         hint="drop --target-bits (and choose --bits 4 or 8), or use fp8 / int8")
    mixed.check_target(spec.target_bits, group_size, spec.symmetric, list(input_widths(source.config).values()))


def _bits_plan(model: Any, spec: Any, job: dict[str, Any], device: str, rep: Any) -> tuple[list[mixed.Unit],
                                                                                           dict[str, Any]]:
    """Measure each layer group's 4-bit sensitivity on the model as loaded (moved to the GPU for it, when there is
    one, and back), then choose which groups go to 8 bits; says the choice in one line."""
    import torch

    found = mixed.units(model, job["ignore"])
    where = "cuda" if device == "cuda" else "cpu"
    if where == "cuda":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        free, _ = torch.cuda.mem_get_info()
        if weights * 1.2 > free:  # the weights, the kept reference log-probabilities and one forward's activations
            raise UsageError(f"--target-bits measures each layer group with the whole model on one GPU, and its "
                             f"{weights / 2**30:.1f} GiB of weights do not fit in the {free / 2**30:.1f} GiB free",
                             hint="use a GPU with more memory, or drop --target-bits")
    with rep.timed("sensitivity"), rep.bar(f"Measuring the 4-bit KLD of {len(found)} layer groups on {where}",
                                           len(found)) as task:
        model.to(where)
        try:
            measured, sensitivity = mixed.measure(model, found, job["samples"] or [], spec.group_size,
                                                  spec.symmetric, task.advance)
        finally:
            model.to("cpu")
    chosen = mixed.choose(measured, spec.target_bits, spec.group_size, spec.symmetric)
    high = [u for u in chosen if u.bits == mixed.HIGH_BITS]
    rep.log(f"bits plan: {len(high)} of {len(chosen)} layer groups at int{mixed.HIGH_BITS} "
            f"({mixed.planned_bits(chosen, spec.group_size, spec.symmetric):.3f} bits per weight planned, "
            f"target {spec.target_bits:g}); estimated KLD {sum(u.kld for u in chosen if u.bits == mixed.LOW_BITS):.4f}"
            f" instead of {sum(u.kld for u in chosen):.4f} with every group at int{mixed.LOW_BITS}")
    return chosen, sensitivity


class CompressedProducer:
    """The ``awq``, ``gptq``, ``autoround``, ``fp8``, ``int8``, ``w4a8`` and ``rtn`` methods."""

    def check(self, spec: Any, source: SourceModel) -> None:
        archs = source.config.get("architectures") or []
        if not vision.family(source.config) and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            from quantkit.architectures import TABLE

            known = ", ".join(a.name for a in TABLE if a.vision)
            raise SourceModelError(
                f"{source.spec} is a {', '.join(archs) or 'model without architectures'}; "
                f"`quantkit {spec.method}` quantizes causal language models (…ForCausalLM) and the vision-language "
                f"families of its architecture table ({known})",
                hint="check config.json's architectures; another vision-language family needs a row in "
                     "quantkit/architectures.py naming its vision parts (DESIGN.md: adding an architecture)")
        choice = group_choice(spec, source)
        _check_tiles(spec, source)
        ignore_mod.effective(spec, source)  # a misspelt --ignore fails here, before anything loads
        if getattr(spec, "target_bits", None) is not None and choice is not None:
            _check_target_bits(choice.apply(spec), source, choice.size)

    def estimate_bytes(self, spec: Any, source: SourceModel) -> int:
        cfg = text_config(source.config)
        vocab, hidden = int(cfg.get("vocab_size") or 0), int(cfg.get("hidden_size") or 0)
        unquantized = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
        params = source.num_parameters or source.size_bytes // 2
        bits = getattr(spec, "bits", 8)
        return int(unquantized * 2 + max(params - unquantized, 0) * bits / 8 * 1.1)

    def produce(self, ctx: ProduceContext) -> Produced:
        spec, rep = ctx.spec, ctx.reporter
        choice = group_choice(spec, ctx.source)
        notes: list[str] = []
        if choice is not None:
            spec = choice.apply(spec)
            if choice.changed:
                notes.append(choice.reason)
                if choice.symmetric is None:  # the default did not fit the model: a warning
                    rep.warn(f"{choice.reason} (--group-size chooses another)")
                else:  # a default chosen for the bits target: its reason names the flags
                    rep.log(choice.reason)
        p = plan(spec)
        if spec.method in _GROUPED and getattr(spec, "target_bits", None) is not None and ctx.runtime.num_gpus > 1:
            raise UsageError("--target-bits measures and quantizes in one process",
                             hint="drop --num-gpus (the model is quantized one layer at a time on one GPU anyway)")
        job = _job(ctx, spec)
        with rep.timed("setup"):  # importing torch and transformers, starting CUDA, the tokenizer
            device = _pin_device(ctx.runtime.device, ctx.runtime.num_gpus)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ctx.source.path, trust_remote_code=job["trust_remote_code"])
        calib = ctx.calibration_set(tokenizer) if p.calibrate else None
        job["samples"] = calib.samples if calib else None
        if ctx.calibration.images:
            job["images"] = _calibration_images(ctx, p, calib)
        description = f"Quantizing {spec.method} ({p.scheme}) with llm-compressor on {device}"
        if ctx.runtime.num_gpus > 1:
            with rep.step("quantize", description + f" x{ctx.runtime.num_gpus} (torchrun)"):
                info = _distributed(job, ctx.runtime.num_gpus)
        else:
            with rep.step("load_model", f"Loading {ctx.source.spec}"), _quiet_backend():
                model = _load_model(job)
            bits_plan = None
            if getattr(spec, "target_bits", None) is not None:
                bits_plan, sensitivity = _bits_plan(model, spec, job, device, rep)
                p = plan(spec, {b: mixed.targets(bits_plan, b) for b in (mixed.LOW_BITS, mixed.HIGH_BITS)})
                description = f"Quantizing {spec.method} ({p.scheme}) with llm-compressor on {device}"
            with rep.layers("quantize", description), _quiet_backend():
                info = _oneshot(model, p, job)
            with rep.step("check", "Checking that every module that should be quantized was"):
                cov = coverage.check(model, job["ignore"], job["config"], p.signed_scales)
                cov.raise_for_failures()
                if bits_plan is not None:
                    mixed.check_bits(model, bits_plan)
            info["coverage"] = cov.manifest()
            with rep.step("save", "Saving the compressed-tensors checkpoint"), _quiet_backend():
                _save(model, tokenizer, ctx.workdir, job["config"], p.save_format)
                if vision.family(ctx.source.config):
                    vision.record_ignored(ctx.workdir, model, job["ignore"])
            del model
            if bits_plan is not None:
                achieved = mixed.measured_bits(ctx.workdir, bits_plan)
                mixed.verify(achieved, spec.target_bits)
                info["mixed"] = mixed.manifest(bits_plan, spec.target_bits, achieved, spec.group_size, spec.symmetric,
                                               sensitivity)
                rep.log(f"bits per weight of the quantized layers: {achieved:.3f} (target {spec.target_bits:g})")
        vl = vision.family(ctx.source.config)
        if vl is not None:
            with rep.step("check_vision", "Checking that the vision tower and projector are as the source has them"):
                vision.copy_processor(ctx.source.path, ctx.workdir)
                info["vision"] = vision.check_kept(ctx.source, ctx.workdir, vl)
            rep.log(f"kept as the source has them: {', '.join(vl.keep)} ({info['vision']['tensors']} tensors, "
                    f"{info['vision']['parameters'] / 1e6:.1f}M parameters, {'/'.join(info['vision']['dtypes'])})")
        tokens = (info.get("moe") or {}).get("expert_tokens")
        warning = moe.low_token_warning(tokens, "llm-compressor calibrated them on tokens routed elsewhere, so their "
                                                "scales may not fit what they see in use") if tokens else None
        if warning:
            rep.warn(warning)
            info["notes"].append(warning)
        quantization = _describe(ctx.workdir, p, info, job["ignore"]) | (choice.manifest() if choice else {})
        return Produced(quantization=quantization, calibration=calib, notes=notes + list(info.get("notes", [])))


PRODUCER = CompressedProducer()


def _calibration_images(ctx: ProduceContext, p: Plan, calib: Any) -> list[str]:
    """The image files of an image+text calibration (recorded with their sha256 in the calibration's manifest);
    refused where no image can be used."""
    from quantkit import images

    if not vision.family(ctx.source.config):
        raise UsageError(f"--calib-images: {ctx.source.spec} is not a vision-language model",
                         hint="drop --calib-images (text calibration is what a language model takes)")
    if calib is None:
        raise UsageError(f"--calib-images: {ctx.spec.method} ({p.scheme}) takes no calibration data",
                         hint="drop --calib-images")
    if ctx.runtime.num_gpus > 1:
        raise UsageError("--calib-images calibrates in one process", hint="drop --num-gpus")
    calib.pictures = images.load(images.folder(ctx.calibration.images))
    return [str(pic.path) for pic in calib.pictures]


# ----------------------------------------------------------------------------------------------------------------
# The job: everything oneshot needs, as plain data (so a torchrun worker can run the same thing)


def _job(ctx: ProduceContext, spec: Any) -> dict[str, Any]:
    return {
        "method": spec.method, "spec": spec.model_dump(mode="json"), "source": str(ctx.source.path),
        "config": ctx.source.config, "ignore": ignore_mod.effective(ctx.spec, ctx.source),
        "dtype": ctx.model.dtype, "trust_remote_code": ctx.model.trust_remote_code,
        "seq_len": ctx.calibration.seq_len, "min_expert_tokens": ctx.calibration.min_expert_tokens,
        "seed": ctx.runtime.seed, "out": str(ctx.workdir),
    }


def _spec_from(job: dict[str, Any]) -> Any:
    from pydantic import TypeAdapter

    from quantkit.recipe import MethodSpec

    return TypeAdapter(MethodSpec).validate_python(job["spec"])


@contextlib.contextmanager
def _quiet_backend() -> Iterator[None]:
    """Silence library bars (:func:`quantkit.progress.silence_library_bars`) and torch.fx's one-line notice about
    llm-compressor's graph tracing while quantkit's own progress runs."""
    import logging

    from quantkit.progress import silence_library_bars

    silence_library_bars()
    fx_log = logging.getLogger("torch.fx._symbolic_trace")
    fx_level = fx_log.level
    fx_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        fx_log.setLevel(fx_level)


def _pin_device(device: str, num_gpus: int) -> str:
    """Make llm-compressor compute where the recipe says.

    llm-compressor 0.14 has no device argument: it always computes on the first visible accelerator
    (``llmcompressor.utils.dev.get_main_device``). So ``cpu`` and ``cuda:N`` are honoured by what this process
    can see, set through CUDA_VISIBLE_DEVICES before CUDA initialises (quantkit touches CUDA nowhere earlier).
    """
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif device.startswith("cuda:"):
        index = device.split(":", 1)[1]
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or None
        if not index.isdigit() or (visible is not None and int(index) >= len(visible)):
            raise UsageError(f"--device {device}: no such GPU", hint="nvidia-smi lists them; or use --device auto")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[int(index)] if visible else index
    import torch

    gpus = torch.cuda.device_count()
    if device == "cpu" and gpus:
        raise UsageError("--device cpu: CUDA was already initialised in this process, so GPUs cannot be hidden",
                         hint="run with CUDA_VISIBLE_DEVICES= set in the environment instead")
    if device.startswith("cuda") and not gpus:
        raise UsageError(f"--device {device}: no CUDA GPU is visible", hint="use --device cpu (slow) or auto")
    if num_gpus > 1 and gpus < num_gpus:
        raise UsageError(f"--num-gpus {num_gpus}: only {gpus} CUDA GPU(s) visible",
                         hint=f"use --num-gpus {max(gpus, 1)}")
    return "cuda" if gpus else "cpu"


def _quiet_llmcompressor_log() -> None:
    """llm-compressor's INFO/WARNING/METRIC lines (one per module for GPTQ) and auto-round's (two per layer) drown
    quantkit's progress, and they go to stdout, which ``--json`` keeps for its one document;
    LLM_COMPRESSOR_LOG_LEVEL=INFO and AR_LOG_LEVEL=INFO show them. Read when llmcompressor is first imported, so this
    runs before every import of it."""
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    os.environ.setdefault("AR_LOG_LEVEL", "ERROR")  # auto-round's own per-layer lines; read when it is imported


def _load_model(job: dict[str, Any], distributed: bool = False) -> Any:
    """The source model on the CPU (the pipelines move layers to the accelerator as they go), experts linearized.

    Not llm-compressor's ``load_context``: its MoE half (``load_quantizable_moe``) loads Qwen-MoE and DeepSeek
    checkpoints straight into per-expert Linears by renaming per-expert tensors, so a checkpoint that stores
    fused 3-D experts leaves every expert randomly initialised, with only transformers' load report to say so; and
    in transformers 5.17 its class patching imports every image processor (which fails without torchvision). Its
    linearization after an ordinary load takes both layouts (:func:`quantkit.producers.moe.linearize`, one block at a
    time so the experts are never held twice). A weight the checkpoint lacks is an error here, never a random
    initialisation.
    """
    _quiet_llmcompressor_log()
    import torch
    import transformers

    # A vision-language checkpoint loads as the class it names (its language model, vision tower and projector).
    auto = transformers.AutoModelForImageTextToText if vision.family(job["config"]) else \
        transformers.AutoModelForCausalLM
    dtype = job["dtype"]
    kwargs: dict[str, Any] = {"dtype": "auto" if dtype == "auto" else getattr(torch, dtype),
                              "trust_remote_code": job["trust_remote_code"]}
    try:
        if distributed:
            from compressed_tensors.offload import load_offloaded_model

            with load_offloaded_model():
                model = auto.from_pretrained(job["source"], device_map="auto_offload", **kwargs)
        else:
            model, info = auto.from_pretrained(job["source"], output_loading_info=True, **kwargs)
            missing = sorted(info.get("missing_keys") or [])
            if missing:
                raise SourceModelError(
                    f"{job['source']}: {len(missing)} weights the model needs are not in the checkpoint "
                    f"(transformers would initialise them at random): {', '.join(missing[:6])}"
                    + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else ""),
                    hint="the checkpoint's tensor names do not match its config.json's architecture")
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: a checkpoint it cannot convert
        raise SourceModelError(
            f"transformers cannot load {job['source']}: {str(e).splitlines()[0][:300]}",
            hint="check that the checkpoint is a complete causal LM (config.json + weights)") from None
    return moe.linearize(model)


@contextlib.contextmanager
def _awq_without_pin_memory(p: Plan) -> Iterator[None]:
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
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _awq_resolved(p: Plan) -> Iterator[list[str]]:
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


def _matching(pattern: str, names: list[str]) -> int:
    """How many module names a compressed-tensors target matches (``re:`` a regular expression, else the name)."""
    import re

    if pattern.startswith("re:"):
        return sum(1 for n in names if re.match(pattern[3:], n))
    return sum(1 for n in names if n == pattern or n.endswith("." + pattern))


def _oneshot(model: Any, p: Plan, job: dict[str, Any]) -> dict[str, Any]:
    """Run llm-compressor's oneshot on a loaded model; returns what the manifest should know about the run."""
    _quiet_llmcompressor_log()
    import torch
    from llmcompressor import oneshot

    torch.manual_seed(job["seed"])
    modifiers = p.build(job["ignore"])
    notes: list[str] = []
    for m in modifiers:
        if type(m).__name__ == "AutoRoundModifier":
            # llm-compressor's default compiles the tuning loop: about 20% faster on a GPU by auto-round's account,
            # while on a CPU compiling each layer's shapes costs more than it saves, and needs a C compiler.
            m.enable_torch_compile = torch.accelerator.is_available()
            notes.append(f"AutoRound's tuning loop {'compiled' if m.enable_torch_compile else 'not compiled'} with "
                         f"torch.compile ({'an' if m.enable_torch_compile else 'no'} accelerator)")
    kwargs: dict[str, Any] = {"moe_calibrate_all_experts": True}
    samples = job.get("samples")
    if samples and job.get("images"):
        from torch.utils.data import DataLoader

        from quantkit import images

        pictures = images.load(Path(job["images"][0]).parent)
        pictures = [pic for pic in pictures if str(pic.path) in job["images"]]
        kwargs["dataset"] = DataLoader(vision.image_samples(Path(job["source"]), samples, pictures, job["seq_len"]),
                                       batch_size=1, collate_fn=lambda batch: batch[0])
    elif samples:
        from datasets import Dataset

        kwargs |= {"dataset": Dataset.from_dict({"input_ids": samples}), "num_calibration_samples": len(samples),
                   "max_seq_length": job["seq_len"], "shuffle_calibration_samples": False}
    scoped: list[str] = []
    if vision.family(job["config"]):
        from transformers import AutoTokenizer

        scoped = vision.scope_modifiers(modifiers, model)
        # The samples are token ids already; without a processor oneshot builds the checkpoint's own, whose image
        # and video processors may need torchvision only to be thrown away.
        kwargs["processor"] = AutoTokenizer.from_pretrained(job["source"], trust_remote_code=job["trust_remote_code"])
    fam = moe.family(job["config"])
    split = _split_awq_router(modifiers, model, fam, job["config"])
    # Under torchrun each rank routes only its share of the samples: counted in one process only.
    counted = fam and samples and not torch.distributed.is_initialized()
    router = moe.RouterTokens(model, fam, job["config"], sum(map(len, samples))) if counted else None
    try:
        with _awq_without_pin_memory(p), _awq_resolved(p) as resolved, router or contextlib.nullcontext():
            oneshot(model=model, recipe=modifiers, **kwargs)
    except torch.OutOfMemoryError as e:
        raise BackendError(f"out of GPU memory while quantizing: {str(e).splitlines()[0][:200]}",
                           hint="lower --samples or --seq-len, or use --num-gpus N") from None
    except (ValueError, RuntimeError, AttributeError, TypeError, KeyError) as e:
        raise BackendError(f"llm-compressor failed ({type(e).__name__}): {str(e).splitlines()[0][:400]}",
                           hint="rerun with --debug for the traceback") from e
    info: dict[str, Any] = {"notes": notes}
    if fam:
        info["moe"] = {"family": fam.name, "experts": fam.num_experts(job["config"]),
                       "top_k": fam.top_k(job["config"]), "layers": fam.layers(job["config"]),
                       "routers": moe.router_patterns(job["config"]), "calibrate_all_experts": True,
                       "expert_tokens": router.summary(job["min_expert_tokens"]) if router else None}
    for m in modifiers:
        if type(m).__name__ == "AWQModifier":
            info["awq_mappings"] = [{"smooth_layer": mp.smooth_layer, "balance_layers": list(mp.balance_layers),
                                     "applied_to": _matching(mp.smooth_layer, resolved)}  # smooth modules
                                    for mp in (m.mappings or [])]
            unused = [f"{mp['smooth_layer']} -> {', '.join(mp['balance_layers'])}" for mp in info["awq_mappings"]
                      if mp["applied_to"] == 0]
            if unused:
                info["notes"].append(f"AWQ mappings llm-compressor applied in no layer ({'; '.join(unused)}): it skips "
                                     "a layer where the smooth layer's outputs are not the balance layers' inputs "
                                     "(v_proj -> o_proj with fewer key-value heads than heads)")
            info["awq_mappings_source"] = _awq_mapping_source(model) + (
                ", its router mapping split into MoE and dense layers by quantkit" if split else "") + (
                ", each scoped to the language model by quantkit" if "AWQModifier" in scoped else "")
            info["notes"].append(f"AWQ smoothing mappings chosen by llm-compressor: {info['awq_mappings_source']}")
            if not torch.accelerator.is_available():
                info["notes"].append("AWQ on CPU: llm-compressor 0.14's activation pinning skipped (no accelerator)")
        if type(m).__name__ == "SmoothQuantModifier":
            info["smoothquant_mappings"] = [[list(b), s] for b, s in (m.mappings or [])]
            if "SmoothQuantModifier" in scoped:
                info["notes"].append("SmoothQuant mappings: llm-compressor's for the architecture, each scoped to the "
                                     "language model by quantkit")
    return info


def _split_awq_router(modifiers: list[Any], model: Any, fam: moe.Family | None, config: dict[str, Any]) -> bool:
    """Give AWQ mappings that work on an MoE with dense layers (:func:`quantkit.producers.moe.awq_mappings`);
    whether they differ from llm-compressor's own."""
    awq = next((m for m in modifiers if type(m).__name__ == "AWQModifier"), None)
    mappings = moe.awq_mappings(model, fam, config) if awq is not None and fam else None
    if mappings is not None:
        awq.mappings = mappings
    return mappings is not None


def _awq_mapping_source(model: Any) -> str:
    from llmcompressor.modifiers.transform.awq import AWQ_DYNAMIC_MAPPING_REGISTRY, AWQ_MAPPING_REGISTRY

    name = type(model).__name__
    if name in AWQ_DYNAMIC_MAPPING_REGISTRY or name in AWQ_MAPPING_REGISTRY:
        return f"its registry entry for {name}"
    return f"its default (Llama-style) mappings: {name} is not in its registry"


def _save(model: Any, tokenizer: Any, out: Path, config: dict[str, Any], save_format: str | None = None) -> None:
    """compressed-tensors weights + config, the tokenizer, and the generation config (save_pretrained writes it);
    an MoE's experts under its checkpoints' own names; ``save_format`` when compressed-tensors would infer the
    wrong one (W4A8)."""
    import warnings

    fam = moe.family(config)
    if fam:
        moe.save_as_checkpoint(model, fam)
    with warnings.catch_warnings():  # transformers warns about 50 GB shards whenever llm-compressor offloaded modules
        warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
        model.save_pretrained(str(out), save_compressed=True, quantization_format=save_format,
                              max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(str(out))


def _describe(out: Path, p: Plan, info: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """The manifest's ``quantization`` section, read back from what was written."""
    from quantkit import versions

    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise BackendError(f"llm-compressor wrote no compressed-tensors quantization_config into {out}/config.json")
    q: dict[str, Any] = {"scheme": p.scheme, **p.summary, "ct_format": qc.get("format"),
                         "quant_method": qc.get("quant_method"), "ignore": qc.get("ignore", []),
                         "ignore_patterns": ignore, "kv_cache_scheme": qc.get("kv_cache_scheme"),
                         "recipe": p.recipe(ignore),
                         "llmcompressor": versions.version("llmcompressor"),
                         "compressed_tensors": versions.version("compressed-tensors")}
    if "awq_mappings" in info:
        q["awq_mappings"] = info["awq_mappings"]
        q["awq_mappings_source"] = info["awq_mappings_source"]
    if "smoothquant_mappings" in info:
        q["smoothquant_mappings"] = info["smoothquant_mappings"]
    if any(name == "AutoRoundModifier" for name, _ in p.modifiers):
        q["auto_round"] = versions.version("auto-round")
    for key in ("coverage", "moe", "mixed", "vision"):
        if key in info:
            q[key] = info[key]
    return q


# ----------------------------------------------------------------------------------------------------------------
# Several GPUs: the same job under torchrun


def _distributed(job: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    """Run the job on ``num_gpus`` GPUs with llm-compressor's distributed oneshot, launched through torchrun.

    Each rank loads the model through llm-compressor's ``load_context`` (rank 0 reads, the others share), calibrates
    its share of the samples (oneshot partitions an identical Dataset by itself), and rank 0 writes the files.
    """
    with tempfile.TemporaryDirectory(prefix="quantkit-ddp-") as work:
        job_path, result_path = Path(work) / "job.json", Path(work) / "result.json"
        job_path.write_text(json.dumps({**job, "result": str(result_path)}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_gpus}",
               "-m", "quantkit.producers.compressed", str(job_path)]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0 or not result_path.exists():
            raise BackendError(f"distributed quantization on {num_gpus} GPUs failed (torchrun exit {proc.returncode})",
                               hint="its log is above; --num-gpus 1 runs the same job in one process")
        return json.loads(result_path.read_text())


def _worker(job_path: str) -> None:
    """One torchrun rank (``python -m quantkit.producers.compressed JOB``)."""
    import torch.distributed as dist
    from compressed_tensors.offload import init_dist
    from transformers import AutoTokenizer

    job = json.loads(Path(job_path).read_text())
    init_dist()
    p = plan(_spec_from(job))
    model = _load_model(job, distributed=True)
    info = _oneshot(model, p, job)
    cov = coverage.check(model, job["ignore"], job["config"], p.signed_scales)
    cov.raise_for_failures()
    info["coverage"] = cov.manifest()
    fam = moe.family(job["config"])
    if fam:
        moe.save_as_checkpoint(model, fam)
    model.save_pretrained(job["out"], save_compressed=True, quantization_format=p.save_format,  # rank 0 writes
                          max_shard_size=SHARD_SIZE)
    if dist.get_rank() == 0:
        AutoTokenizer.from_pretrained(job["source"], trust_remote_code=job["trust_remote_code"]).save_pretrained(
            job["out"])
        if vision.family(job["config"]):
            vision.record_ignored(Path(job["out"]), model, job["ignore"])
        Path(job["result"]).write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
