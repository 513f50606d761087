"""A bits target: which layers stay at 4 bits and which go to 8, chosen by measured sensitivity, then checked.

``--target-bits B`` asks for an average of B bits per weight over the quantized linear layers, counted as the
checkpoint stores them (packed weights, scales and zero points over the layers' weights: 4.25 for int4 in groups of
64 with bf16 scales, 4.5 for NVFP4, 4.25 for MXFP4). quantkit gets there by keeping the layers that hurt most at 4 bits
in 8 bits instead, and measures "hurt" rather than guessing it. The two sides of a mix are :class:`Precision` rows
(:func:`precisions`): int4 and int8 with the method's group size for awq, gptq and rtn; NVFP4 or MXFP4 and the FP4
spec's ``--high`` (int8 weight-only or FP8-dynamic, per output channel) for nvfp4 and mxfp4.

1. **Units.** The layers are grouped as vLLM fuses them (q/k/v into one ``qkv_proj``, gate/up into one
   ``gate_up_proj``: :data:`FUSED`): vLLM serves one scheme per fused layer, so a unit is all-4 or all-8.
2. **Sensitivity.** On the first :data:`SENSITIVITY_TOKENS` calibration tokens, each unit alone is round-to-nearest
   quantized at the low precision (compressed-tensors' own ``fake_quantize``: int4 with the method's group size and
   symmetry, or FP4's E2M1 grid with its group scales, NVFP4's global scale shared by the fused layers as
   llm-compressor shares it; the same values as llm-compressor's round-to-nearest with min-max, to the bit) and the
   KL divergence of the model's next-token distributions from the unquantized model's is measured at every
   :data:`SCORE_EVERY`-th token (transformers' ``logits_to_keep``): one forward pass per unit. This is llama.cpp's
   and ModelOpt AutoQuantize's idea (spend bits where the loss is), measured at the output rather than read from a
   proxy; RTN's error stands in for the method's, whose ranking it shares (GPTQ and AWQ shrink every layer's error,
   not the order). A second run on the same source and calibration reads it back
   (:mod:`quantkit.producers.sensitivity`).
3. **Choice.** A knapsack solved greedily: units by KLD saved per extra bit, each taken while the average stays at
   or below the target; then one more unit when that lands nearer the target, over it (:func:`pick`). Where the
   units are few and large (a small model), neither may come within :data:`TOLERANCE` of a target inside the
   range :func:`check_target` accepts: the mixes nearest the target are then searched over all counts of each unit
   size, the most KLD saved per bit first within a size, and when none is within the tolerance the run is refused
   (exit 2) right after the plan, before the method runs, naming the nearest reachable bits. The sum of the KLDs of
   the units left at 4 bits is the plan's estimate.
4. **The run.** The method (GPTQ, AWQ, RTN) runs once with two compressed-tensors config groups, one per precision,
   each listing its modules; vLLM's compressed-tensors loader and transformers read per-module schemes (FP4 mixes:
   a mixed-precision checkpoint, each group in its own format; which mixes vLLM 0.26 loads is
   :data:`quantkit.formats.specs.FP4_MIXES`, and the others are refused before any work).
5. **Checks.** After quantizing, every module carries the precision the plan gave it (:func:`check_bits`), with its
   own scheme's scales (:mod:`quantkit.producers.coverage`); after saving,
   the bits per weight are counted from the files' tensor headers (:func:`measured_bits`) and the run fails (exit 1,
   nothing published) when they are more than :data:`TOLERANCE` from the target.

The plan, every unit's measured KLD and the measured bits go into the manifest (``quantization.mixed``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError, UsageError
from quantkit.formats.names import Method

LOW_BITS, HIGH_BITS = 4, 8
SENSITIVITY_TOKENS = 2048  # calibration tokens run through the model for each unit
SCORE_EVERY = 4  # the KLD is taken at every 4th of them (the vocabulary projection is most of a small model's cost)
TOLERANCE = 0.1  # how far the measured bits per weight may be from the target
SCALE_BITS = 16  # int and per-channel scales are stored in the model's bf16/fp16
# The int8 layers are symmetric whatever the method's own symmetry: vLLM 0.26 serves no asymmetric int8 weights
# (Marlin takes zero points with uint4 only, Machete needs output widths in multiples of 128; measured on the H200
# with an AWQ mix of SmolLM2), and at 8 bits a zero point buys next to nothing.
HIGH_SYMMETRIC = True
# Sibling projections vLLM fuses into one layer (its models' packed_modules_mapping): they share one scheme.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


@dataclass(frozen=True)
class Precision:
    """One side of a mix, as the checkpoint stores a layer at it and as the sensitivity pass imitates it."""

    name: str  # what messages call it: int4, int8, nvfp4, mxfp4, fp8
    bits: int  # the values' width: what :func:`check_bits` reads back from each module's scheme
    type: str = "int"  # compressed-tensors' QuantizationType of the weights: int or float
    group_size: int = -1  # weights per scale along a layer's input; -1: one scale per output channel
    scale_bits: int = SCALE_BITS  # one scale's width: bf16/fp16, or FP4's 8-bit E4M3 and E8M0
    zero_points: bool = False  # asymmetric int: a zero point per group, stored at ``bits``
    tensor_bits: int = 0  # a per-tensor scale per module: NVFP4's FP32 global scale
    preset: str | None = None  # the compressed-tensors preset whose weight arguments these are (FP4, FP8-dynamic)
    words: str = ""  # how the manifest and the plan describe it

    def per_weight(self, in_features: int) -> float:
        """What one weight costs on disk: its value, its share of the group's scale (and zero point)."""
        group = self.group_size if self.group_size > 0 else in_features
        return self.bits + (self.scale_bits + (self.bits if self.zero_points else 0)) / group

    def cost(self, unit: Unit) -> float:
        """Stored bits of a unit at this precision, its modules' per-tensor scales included."""
        return unit.params * self.per_weight(unit.in_features) + self.tensor_bits * len(unit.modules)

    def quantize(self, weights: list[Any]) -> list[Any]:
        """The unit's weights as round-to-nearest at this precision leaves them."""
        if self.preset is None:
            return [fake_quantize(w, self.bits, self.group_size, not self.zero_points) for w in weights]
        return fp_fake_quantize(weights, self.preset)

    def carried_by(self, weights: Any) -> bool:
        """Whether a module's weight quantization arguments are this precision's."""
        group = getattr(weights, "group_size", None) or -1
        kind = getattr(weights, "type", None)
        return (getattr(weights, "num_bits", None) == self.bits and getattr(kind, "value", kind) == self.type
                and group == self.group_size)


def int_precision(bits: int, group_size: int, symmetric: bool) -> Precision:
    """int``bits`` weights in groups of ``group_size`` (-1: per output channel), with zero points unless symmetric."""
    grouping = "per-channel" if group_size <= 0 else f"group {group_size}"
    return Precision(f"int{bits}", bits, "int", group_size, zero_points=not symmetric,
                     words=f"int{bits} {grouping} {'symmetric' if symmetric else 'asymmetric'}")


# FP4 (compressed-tensors 0.19's presets; weights alike in their W4A16 and W4A4 forms) and the 8-bit layers an FP4 mix
# may hold, as vLLM 0.26 loads them (bench/results/h200/fp4/mixes.md): FP8-dynamic's preset, and int8 weight-only with
# one scale per output channel, which fits any width (vLLM's W8A16 preset groups 128, which SmolLM2's 576 does not
# divide; Machete and Marlin take per-channel int8).
FP4 = {Method.NVFP4: Precision("nvfp4", 4, "float", 16, 8, tensor_bits=32, preset="NVFP4A16",
                               words="nvfp4 (e2m1 groups of 16, fp8 e4m3 scales, fp32 global scale)"),
       Method.MXFP4: Precision("mxfp4", 4, "float", 32, 8, preset="MXFP4A16",
                               words="mxfp4 (e2m1 groups of 32, e8m0 scales)")}
FP4_HIGH = {Method.INT8: int_precision(HIGH_BITS, -1, True),
            Method.FP8: Precision("fp8", HIGH_BITS, "float", preset="FP8_DYNAMIC",
                                  words="fp8 e4m3 per-channel, fp8 dynamic per-token activations")}


def precisions(spec: Any) -> tuple[Precision, Precision]:
    """The two sides of a spec's mix: FP4 and its ``--high`` for nvfp4 and mxfp4; int4 and int8 with the method's
    group size for awq, gptq and rtn (int8 symmetric: :data:`HIGH_SYMMETRIC`)."""
    if spec.method in FP4:
        return FP4[spec.method], FP4_HIGH[spec.high_precision]
    return (int_precision(LOW_BITS, spec.group_size, spec.symmetric),
            int_precision(HIGH_BITS, spec.group_size, spec.symmetric or HIGH_SYMMETRIC))


def describe(spec: Any, widths: list[int]) -> str:
    """The bits target's plan in one line, before anything loads (``--dry-run``): its two precisions, what each
    costs alone on these input widths, and how the layer groups between them are chosen."""
    low, high = precisions(spec)
    return (f"bits target {spec.target_bits:g}: each layer group at {low.words} or {high.words} "
            f"({max(low.per_weight(w) for w in widths):.2f} and {min(high.per_weight(w) for w in widths):.2f} bits per "
            f"weight alone), the costliest per bit at {high.name} by each group's {low.name} KLD on the first "
            f"{SENSITIVITY_TOKENS:,} calibration tokens (read from quantkit's cache when an earlier run measured it on "
            "the same source and tokens)")


@dataclass(frozen=True)
class Unit:
    """Layers quantized at one precision together (a vLLM-fused group, or one layer)."""

    name: str
    modules: tuple[str, ...]
    params: int
    in_features: int
    kld: float = math.nan  # measured: this unit alone at the low precision
    bits: int = LOW_BITS  # the plan's choice


def check_target(target: float, low: Precision, high: Precision, widths: list[int]) -> None:
    """Refuse, before loading, a target no mix of the two precisions reaches (exit 2)."""
    lo = max(low.per_weight(w) for w in widths)
    hi = min(high.per_weight(w) for w in widths)
    if not lo - TOLERANCE <= target <= hi + TOLERANCE:
        raise UsageError(f"--target-bits {target:g} is outside what {low.name} and {high.name} layers mix to "
                         f"here ({lo:.2f} to {hi:.2f} bits per weight, scales included)",
                         hint=f"choose a target between {lo:.2f} and {hi:.2f}, or drop --target-bits for "
                              f"{low.name} everywhere")


def units(model: Any, ignore: list[str]) -> list[Unit]:
    """The quantized Linear layers (not ignored) grouped as vLLM fuses them, in model order."""
    import torch
    from compressed_tensors.utils import is_match

    linear = {n: m for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and not is_match(n, m, ignore)}
    out: list[Unit] = []
    seen: set[str] = set()
    for name, module in linear.items():
        if name in seen:
            continue
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED if leaf in g), (leaf,))
        members = tuple(f"{parent}.{x}" if parent else x for x in group if (f"{parent}.{x}" if parent else x) in linear)
        seen.update(members)
        label = f"{parent}.{'+'.join(m.rpartition('.')[2] for m in members)}" if parent else name
        out.append(Unit(label, members, sum(linear[m].weight.numel() for m in members), module.in_features))
    return out


def fake_quantize(weight: Any, bits: int, group_size: int, symmetric: bool) -> Any:
    """Round-to-nearest with compressed-tensors' own arithmetic: what the weight looks like once quantized."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as qdq
    from compressed_tensors.quantization.utils import calculate_qparams

    grouped = group_size > 0
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group" if grouped else "channel",
                            group_size=group_size if grouped else None)
    w = weight.float()
    view = w.view(w.shape[0], -1, group_size) if grouped else w.view(w.shape[0], 1, -1)
    scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), args)
    if not grouped:
        scale, zero = scale.view(-1, 1), zero.view(-1, 1)
    with torch.no_grad():
        return qdq(w, scale, zero, args).to(weight.dtype)


def fp_fake_quantize(weights: list[Any], preset: str) -> list[Any]:
    """Round-to-nearest into a float preset's grid with compressed-tensors' own arithmetic (FP4's E2M1 values with
    NVFP4's E4M3 group scales under one FP32 global scale, or MXFP4's E8M0 power-of-two scales; FP8 per channel),
    each group's range its min and max as llm-compressor's min-max observer takes it. A fused unit's layers share
    NVFP4's global scale, from their largest weight, as llm-compressor fuses them (``fuse_weight_observers``)."""
    import torch
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as qdq
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = preset_name_to_scheme(preset, ["Linear"]).weights
    ws = [w.float() for w in weights]
    shared = None
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        # from the largest weight in the weights' own dtype, as llm-compressor's observer computes it (the same
        # FP32 global scale to the bit)
        absmax = torch.stack([w.abs().amax() for w in weights]).amax().reshape(1)
        shared = generate_gparam(-absmax, absmax)
    out = []
    with torch.no_grad():
        for w, original in zip(ws, weights):
            grouped = args.group_size is not None  # the ranges, too, in the weights' dtype, as the observer's
            view = original.view(w.shape[0], -1, args.group_size) if grouped else original.view(w.shape[0], 1, -1)
            scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), args, global_scale=shared)
            out.append(qdq(w, scale, zero, args, global_scale=shared).to(original.dtype))
    return out


def measure(model: Any, found: list[Unit], samples: list[list[int]], low: Precision,
            advance: Callable[[], None]) -> tuple[list[Unit], dict[str, Any]]:
    """Each unit's KLD with only it at the low precision, on the first :data:`SENSITIVITY_TOKENS` tokens.

    The model runs where it is; the unquantized log-probabilities are computed once and kept (tokens x vocabulary
    in float32). Weights are swapped in place and restored after each unit."""
    import torch

    batches, total = [], 0
    for s in samples:
        if total >= SENSITIVITY_TOKENS:
            break
        take = s[: SENSITIVITY_TOKENS - total]
        batches.append(torch.tensor([take]))
        total += len(take)
    if not batches:
        raise UsageError("--target-bits measures each layer's sensitivity on calibration tokens, and there are none",
                         hint="give --samples and --seq-len")
    device = next(model.parameters()).device
    modules = dict(model.named_modules())
    t0 = time.monotonic()

    def logprobs() -> list[Any]:
        out = []
        with torch.no_grad():
            for b in batches:
                keep = torch.arange(0, b.shape[1], SCORE_EVERY, device=device)
                out.append(torch.log_softmax(model(b.to(device), logits_to_keep=keep).logits[0].float(), -1))
        return out

    reference = logprobs()
    scored = sum(r.shape[0] for r in reference)
    measured: list[Unit] = []
    for unit in found:
        originals = {m: modules[m].weight.data for m in unit.modules}
        for m, quantized in zip(unit.modules, low.quantize(list(originals.values()))):
            modules[m].weight.data = quantized
        try:
            kld = sum(float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum"))
                      for p, q in zip(reference, logprobs())) / scored
        finally:
            for m in unit.modules:
                modules[m].weight.data = originals[m]
        measured.append(Unit(unit.name, unit.modules, unit.params, unit.in_features, max(kld, 0.0)))
        advance()
    return measured, {"tokens": total, "scored": scored, "seconds": round(time.monotonic() - t0, 1),
                      "proxy": f"round-to-nearest {low.words}, one unit at a time"}


def choose(measured: list[Unit], target: float, low: Precision, high: Precision) -> list[Unit]:
    """The units at the high precision for ``target``, by :func:`pick` (the plan's bits within :data:`TOLERANCE` of
    it, or a refusal naming the nearest reachable bits)."""
    params = sum(u.params for u in measured)
    extra = {u.name: high.cost(u) - low.cost(u) for u in measured}
    raised = pick({u.name: u.kld for u in measured}, extra, sum(low.cost(u) for u in measured), params, target)
    return [Unit(u.name, u.modules, u.params, u.in_features, u.kld, HIGH_BITS if u.name in raised else LOW_BITS)
            for u in measured]


def greedy(gain: dict[str, float], extra: dict[str, float], room: float) -> set[str]:
    """A knapsack solved greedily: the names with the most ``gain`` per ``extra`` bit first, each taken while the
    bits it adds fit in what is left of ``room``."""
    taken: set[str] = set()
    for name in _by_gain_per_bit(gain, extra):
        if extra[name] <= room:
            taken.add(name)
            room -= extra[name]
    return taken


def _by_gain_per_bit(gain: dict[str, float], extra: dict[str, float]) -> list[str]:
    """The names, the most ``gain`` per ``extra`` bit first: the order every choice here takes them in."""
    return sorted(gain, key=lambda n: gain[n] / extra[n] if extra[n] > 0 else math.inf, reverse=True)


def pick(gain: dict[str, float], extra: dict[str, float], base: float, weights: int, target: float) -> set[str]:
    """The names to raise so that ``(base + their extra bits) / weights`` lands within :data:`TOLERANCE` of
    ``target``, the nearest of: :func:`greedy`'s choice (at or below the target), that plus the one name (the most
    gain per bit among equals) that lands nearest over it, and, where neither is within the tolerance because the
    units are few and large, the mix within it that saves the most gain over all counts of each unit size
    (:func:`_best_mix`).

    Raises :class:`UsageError` (exit 2) naming the nearest reachable bits when no mix is within the tolerance: the
    target lies between two mixes more than twice the tolerance apart, so running the method would only fail the
    check after the save."""
    room = target * weights - base
    order = _by_gain_per_bit(gain, extra)
    taken = greedy(gain, extra, room)
    spent = sum(extra[n] for n in taken)
    over = min((n for n in order if n not in taken), key=lambda n: abs(spent + extra[n] - room), default=None)
    if over is not None and abs(spent + extra[over] - room) < abs(spent - room):
        taken, spent = taken | {over}, spent + extra[over]
    slack = TOLERANCE * weights * (1 - 1e-9)  # the files' count must pass verify()'s test, rounding included
    if abs(spent - room) <= slack:
        return taken
    best, under, above = _best_mix(order, gain, extra, room, slack, weights)
    if best is not None:
        return best
    reachable = " and ".join(f"{(base + x) / weights:.3f}" for x in (under, above) if x is not None)
    raise UsageError(f"--target-bits {target:g} is more than {TOLERANCE} from every mix these layer groups make "
                     f"(the nearest: {reachable} bits per weight); nothing was quantized",
                     hint=f"choose a target within {TOLERANCE} of {reachable.replace(' and ', ' or ')}; the "
                          "sensitivity just measured is cached, so the next run plans at once")


def _best_mix(order: list[str], gain: dict[str, float], extra: dict[str, float], room: float, slack: float,
              weights: int) -> tuple[set[str] | None, float, float | None]:
    """Of the mixes whose extra bits are within ``slack`` of ``room``, the one saving the most ``gain`` (None: there
    is none), and the extra bits of the nearest mixes at or below ``room`` and above ``room + slack`` (None: none).

    A knapsack over how many units of each size are raised, the names of a size taken in ``order`` (the most gain
    per bit first). Sums are kept one per step of a thousandth of the tolerance, the one saving most, so the search
    is bounded (at most 40,000 sums per size, whatever the model) and within a few thousandths of a bit of exact."""
    sizes: dict[float, list[str]] = {}
    for n in order:
        if extra[n] > 0:  # a name that adds no bits is no choice: greedy() has taken it
            sizes.setdefault(round(extra[n], 3), []).append(n)
    step = TOLERANCE * weights / 1000
    sums: dict[int, tuple[float, float, tuple[int, ...]]] = {0: (0.0, 0.0, ())}  # step -> (sum, gain, counts)
    above: float | None = None
    for size, names in sizes.items():
        grown: dict[int, tuple[float, float, tuple[int, ...]]] = {}
        first = [0.0]  # the gain of raising the first c names of this size
        for n in names:
            first.append(first[-1] + gain[n])
        for total, saved, counts in sums.values():
            for c in range(len(names) + 1):
                s = total + c * size
                if s > room + slack:  # raising more of this size, or any other, only moves further above
                    above = s if above is None else min(above, s)
                    break
                state = (s, saved + first[c], counts + (c,))
                key = int(s // step)
                if key not in grown or state[1] > grown[key][1]:
                    grown[key] = state
        sums = grown
    groups = list(sizes.values())
    near = [m for m in sums.values() if abs(m[0] - room) <= slack]
    best = max(near, key=lambda m: m[1], default=None)
    chosen = {n for group, c in zip(groups, best[2]) for n in group[:c]} if best else None
    return chosen, max(m[0] for m in sums.values()), above


def planned_bits(plan: list[Unit], low: Precision, high: Precision) -> float:
    """The plan's bits per weight, as :func:`measured_bits` will count them from the files."""
    return sum((high if u.bits == HIGH_BITS else low).cost(u) for u in plan) / sum(u.params for u in plan)


def targets(plan: list[Unit], bits: int) -> list[str]:
    """The compressed-tensors targets of the modules at ``bits``: one anchored regular expression per projection
    name, listing the layers (``re:model\\.layers\\.(0|5|9)\\.self_attn\\.q_proj$``), so config.json stays short."""
    by_leaf: dict[tuple[str, str], list[str]] = {}
    for u in plan:
        if u.bits != bits:
            continue
        for m in u.modules:
            found = re.fullmatch(r"(.*\.)(\d+)(\..+)", m)
            key, index = ((found.group(1), found.group(3)), found.group(2)) if found else ((m, ""), "")
            by_leaf.setdefault(key, []).append(index)
    out = []
    for (head, tail), indices in by_leaf.items():
        if indices == [""]:
            out.append(f"re:^{re.escape(head)}$")
        else:
            out.append(f"re:^{re.escape(head)}({'|'.join(indices)}){re.escape(tail)}$")
    return out


def check_bits(model: Any, plan: list[Unit], low: Precision, high: Precision) -> None:
    """Every planned module carries the precision the plan gave it: its weight bits, type (int or float) and group
    size, so a module matched by both config groups, or by the wrong one, fails (exit 1, nothing written)."""
    modules = dict(model.named_modules())
    wrong = []
    for u in plan:
        want = high if u.bits == HIGH_BITS else low
        for m in u.modules:
            weights = getattr(getattr(modules.get(m), "quantization_scheme", None), "weights", None)
            if not want.carried_by(weights):
                got = (f"{getattr(weights, 'type', '?')}{getattr(weights, 'num_bits', '?')} group "
                       f"{getattr(weights, 'group_size', None) or -1}" if weights is not None else "unquantized")
                wrong.append(f"{m} ({got} instead of {want.name})")
    if wrong:
        raise BackendError(f"the bits plan was not applied, nothing was written: {len(wrong)} modules carry other "
                           f"weight bits: {', '.join(wrong[:6])}" + (f" (+{len(wrong) - 6} more)" if len(wrong) > 6
                                                                     else ""),
                           hint="rerun with --debug; the plan is in the log above")


def measured_bits(folder: Path, plan: list[Unit]) -> float:
    """Bits per weight of the planned modules as written: their weight tensors' bytes (packed values, scales,
    zero points) from the safetensors headers, over their weights."""
    from quantkit.source import safetensors_header, stored_weight_tensor

    wanted = {m for u in plan for m in u.modules}
    stored = 0
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = safetensors_header(path)
        for name, info in header.items():
            module, _, tensor = name.rpartition(".")
            if module in wanted and stored_weight_tensor(tensor):
                start, end = info["data_offsets"]
                stored += end - start
    return stored * 8 / sum(u.params for u in plan)


def verify(achieved: float, target: float, planned: float | None = None) -> None:
    """Fail the run (exit 1, nothing written) when the bits counted from the files are more than :data:`TOLERANCE`
    from the target; the hint blames the stored layers only when the plan (``planned``) was within it."""
    if abs(achieved - target) <= TOLERANCE:
        return
    if planned is None:
        hint = "compare the bits plan in the log above with what was stored; rerun with --debug"
    elif abs(planned - target) > TOLERANCE:
        hint = (f"the plan itself had {planned:.3f} bits per weight: choose a target within {TOLERANCE} of what the "
                "layer groups mix to here")
    else:
        hint = f"the plan had {planned:.3f}: a layer was stored otherwise than planned; rerun with --debug"
    raise BackendError(f"the artifact has {achieved:.3f} bits per weight in its quantized layers, more than "
                       f"{TOLERANCE} from --target-bits {target:g}; nothing was written", hint=hint)


def manifest(plan: list[Unit], target: float, achieved: float, low: Precision, high: Precision,
             sensitivity: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``quantization.mixed`` section: the target, what was planned and measured, every unit."""
    raised = [u for u in plan if u.bits == HIGH_BITS]
    return {"target_bits": target, "planned_bits": round(planned_bits(plan, low, high), 4),
            "measured_bits": round(achieved, 4), "tolerance": TOLERANCE, "low": low.words, "high": high.words,
            "precisions": {str(LOW_BITS): sum(u.params for u in plan if u.bits == LOW_BITS),
                           str(HIGH_BITS): sum(u.params for u in raised)},
            "units_at_high": len(raised), "units": len(plan),
            "estimated_kld": round(sum(u.kld for u in plan if u.bits == LOW_BITS), 5),
            "estimated_kld_all_low": round(sum(u.kld for u in plan), 5),
            "sensitivity": sensitivity,
            "plan": [{k: v for k, v in asdict(u).items() if k != "in_features"} for u in plan]}
