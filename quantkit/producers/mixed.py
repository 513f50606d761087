"""A bits target: which layers stay at 4 bits and which go to 8, chosen by measured sensitivity, then checked.

``--target-bits B`` asks for an average of B bits per weight over the quantized linear layers, counted as the
checkpoint stores them (packed weights, scales and zero points over the layers' weights: 4.25 for int4 in groups of
64 with bf16 scales). quantkit gets there by keeping the layers that hurt most at 4 bits in 8 bits instead, with the
same group size, and measures "hurt" rather than guessing it:

1. **Units.** The layers are grouped as vLLM fuses them (q/k/v into one ``qkv_proj``, gate/up into one
   ``gate_up_proj``: :data:`FUSED`): vLLM serves one scheme per fused layer, so a unit is all-4 or all-8.
2. **Sensitivity.** On the first :data:`SENSITIVITY_TOKENS` calibration tokens, each unit alone is round-to-nearest
   quantized at the low precision (compressed-tensors' own ``fake_quantize``, the method's group size and symmetry)
   and the KL divergence of the model's next-token distributions from the unquantized model's is measured at every
   :data:`SCORE_EVERY`-th token (transformers' ``logits_to_keep``): one forward pass per unit. This is llama.cpp's
   and ModelOpt AutoQuantize's idea (spend bits where the loss is), measured at the output rather than read from a
   proxy; RTN's error stands in for the method's, whose ranking it shares (GPTQ and AWQ shrink every layer's error,
   not the order).
3. **Choice.** A knapsack solved greedily: units by KLD saved per extra bit, each taken while the average stays at
   or below the target. The sum of the KLDs of the units left at 4 bits is the plan's estimate.
4. **The run.** The method (GPTQ, AWQ, RTN) runs once with two compressed-tensors config groups, one per precision,
   each listing its modules; vLLM's compressed-tensors loader and transformers read per-module schemes.
5. **Checks.** After quantizing, every module carries the bits the plan gave it (:func:`check_bits`); after saving,
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

LOW_BITS, HIGH_BITS = 4, 8
SENSITIVITY_TOKENS = 2048  # calibration tokens run through the model for each unit
SCORE_EVERY = 4  # the KLD is taken at every 4th of them (the vocabulary projection is most of a small model's cost)
TOLERANCE = 0.1  # how far the measured bits per weight may be from the target
SCALE_BITS = 16  # scales are stored in the model's bf16/fp16
# The int8 layers are symmetric whatever the method's own symmetry: vLLM 0.26 serves no asymmetric int8 weights
# (Marlin takes zero points with uint4 only, Machete needs output widths in multiples of 128; measured on the H200
# with an AWQ mix of SmolLM2), and at 8 bits a zero point buys next to nothing.
HIGH_SYMMETRIC = True
# Sibling projections vLLM fuses into one layer (its models' packed_modules_mapping): they share one scheme.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


def bits_per_weight(bits: int, group_size: int, in_features: int, symmetric: bool) -> float:
    """What one weight costs on disk at ``bits``: the value, its share of the group's scale (and zero point)."""
    group = group_size if group_size > 0 else in_features
    return bits + (SCALE_BITS + (0 if symmetric else bits)) / group


@dataclass(frozen=True)
class Unit:
    """Layers quantized at one precision together (a vLLM-fused group, or one layer)."""

    name: str
    modules: tuple[str, ...]
    params: int
    in_features: int
    kld: float = math.nan  # measured: this unit alone at the low precision
    bits: int = LOW_BITS  # the plan's choice

    def cost(self, bits: int, group_size: int, symmetric: bool) -> float:
        """Stored bits of the unit at ``bits`` (the high precision always symmetric: :data:`HIGH_SYMMETRIC`)."""
        symmetric = symmetric or (bits == HIGH_BITS and HIGH_SYMMETRIC)
        return self.params * bits_per_weight(bits, group_size, self.in_features, symmetric)


def check_target(target: float, group_size: int, symmetric: bool, widths: list[int]) -> None:
    """Refuse, before loading, a target no mix of the two precisions reaches (exit 2)."""
    lo = max(bits_per_weight(LOW_BITS, group_size, w, symmetric) for w in widths)
    hi = min(bits_per_weight(HIGH_BITS, group_size, w, symmetric or HIGH_SYMMETRIC) for w in widths)
    if not lo - TOLERANCE <= target <= hi + TOLERANCE:
        raise UsageError(f"--target-bits {target:g} is outside what int{LOW_BITS} and int{HIGH_BITS} layers mix to "
                         f"here ({lo:.2f} to {hi:.2f} bits per weight, scales included)",
                         hint=f"choose a target between {lo:.2f} and {hi:.2f}, or drop --target-bits for int4 "
                              "everywhere")


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


def measure(model: Any, found: list[Unit], samples: list[list[int]], group_size: int, symmetric: bool,
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
        originals = {m: modules[m].weight.data.clone() for m in unit.modules}
        for m in unit.modules:
            modules[m].weight.data = fake_quantize(originals[m], LOW_BITS, group_size, symmetric)
        try:
            kld = sum(float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum"))
                      for p, q in zip(reference, logprobs())) / scored
        finally:
            for m in unit.modules:
                modules[m].weight.data = originals[m]
        measured.append(Unit(unit.name, unit.modules, unit.params, unit.in_features, max(kld, 0.0)))
        advance()
    grouping = "per-channel" if group_size <= 0 else f"group {group_size}"
    return measured, {"tokens": total, "scored": scored, "seconds": round(time.monotonic() - t0, 1),
                      "proxy": f"round-to-nearest int{LOW_BITS} {grouping} {'symmetric' if symmetric else 'asymmetric'}"
                               ", one unit at a time"}


def choose(measured: list[Unit], target: float, group_size: int, symmetric: bool) -> list[Unit]:
    """The units at the high precision: most KLD saved per extra bit first, while the average stays at or below
    ``target``."""
    params = sum(u.params for u in measured)
    extra = {u.name: u.cost(HIGH_BITS, group_size, symmetric) - u.cost(LOW_BITS, group_size, symmetric)
             for u in measured}
    room = target * params - sum(u.cost(LOW_BITS, group_size, symmetric) for u in measured)
    high = greedy({u.name: u.kld for u in measured}, extra, room)
    return [Unit(u.name, u.modules, u.params, u.in_features, u.kld, HIGH_BITS if u.name in high else LOW_BITS)
            for u in measured]


def greedy(gain: dict[str, float], extra: dict[str, float], room: float) -> set[str]:
    """A knapsack solved greedily: the names with the most ``gain`` per ``extra`` bit first, each taken while the
    bits it adds fit in what is left of ``room``."""
    taken: set[str] = set()
    for name in sorted(gain, key=lambda n: gain[n] / extra[n] if extra[n] > 0 else math.inf, reverse=True):
        if extra[name] <= room:
            taken.add(name)
            room -= extra[name]
    return taken


def planned_bits(plan: list[Unit], group_size: int, symmetric: bool) -> float:
    return sum(u.cost(u.bits, group_size, symmetric) for u in plan) / sum(u.params for u in plan)


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


def check_bits(model: Any, plan: list[Unit]) -> None:
    """Every planned module carries the weight bits the plan gave it (else exit 1, nothing written)."""
    modules = dict(model.named_modules())
    wrong = []
    for u in plan:
        for m in u.modules:
            scheme = getattr(modules.get(m), "quantization_scheme", None)
            got = getattr(getattr(scheme, "weights", None), "num_bits", None)
            if got != u.bits:
                wrong.append(f"{m} ({got} instead of {u.bits})")
    if wrong:
        raise BackendError(f"the bits plan was not applied, nothing was written: {len(wrong)} modules carry other "
                           f"weight bits: {', '.join(wrong[:6])}" + (f" (+{len(wrong) - 6} more)" if len(wrong) > 6
                                                                     else ""),
                           hint="rerun with --debug; the plan is in the log above")


def measured_bits(folder: Path, plan: list[Unit]) -> float:
    """Bits per weight of the planned modules as written: their weight tensors' bytes (packed values, scales,
    zero points) from the safetensors headers, over their weights."""
    from quantkit.source import safetensors_header

    wanted = {m for u in plan for m in u.modules}
    stored = 0
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = safetensors_header(path)
        for name, info in header.items():
            module, _, tensor = name.rpartition(".")
            if module in wanted and tensor.startswith("weight") and tensor != "weight_shape":
                start, end = info["data_offsets"]
                stored += end - start
    return stored * 8 / sum(u.params for u in plan)


def verify(achieved: float, target: float) -> None:
    if abs(achieved - target) > TOLERANCE:
        raise BackendError(f"the artifact has {achieved:.3f} bits per weight in its quantized layers, more than "
                           f"{TOLERANCE} from --target-bits {target:g}; nothing was written",
                           hint="a layer was stored otherwise than planned; rerun with --debug")


def manifest(plan: list[Unit], target: float, achieved: float, group_size: int, symmetric: bool,
             sensitivity: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``quantization.mixed`` section: the target, what was planned and measured, every unit."""
    high = [u for u in plan if u.bits == HIGH_BITS]
    return {"target_bits": target, "planned_bits": round(planned_bits(plan, group_size, symmetric), 4),
            "measured_bits": round(achieved, 4), "tolerance": TOLERANCE,
            "precisions": {str(LOW_BITS): sum(u.params for u in plan if u.bits == LOW_BITS),
                           str(HIGH_BITS): sum(u.params for u in high)},
            "units_at_high": len(high), "units": len(plan),
            "estimated_kld": round(sum(u.kld for u in plan if u.bits == LOW_BITS), 5),
            "estimated_kld_all_low": round(sum(u.kld for u in plan), 5),
            "sensitivity": sensitivity,
            "plan": [{k: v for k, v in asdict(u).items() if k != "in_features"} for u in plan]}
