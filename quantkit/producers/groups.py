"""Group sizes and tiles, checked against the source's widths before anything loads.

A weight group runs along a layer's input, so every quantized layer's input width must be a whole number of groups:
:func:`group_choice` resolves a spec's group size on a source (an unset one is 128, or the largest size vLLM's
kernels take that divides every width, or for ``gptq --target-bits`` from 5.5 bits int4 in groups of 32 with zero
points) and refuses a given one that does not divide; :func:`check_tiles` refuses the schemes whose tiles are fixed at
128 (W4A8, FP8 block) where 128 does not divide. The compressed-tensors producer, ``--dry-run``
(:mod:`quantkit.plan`) and the legacy layouts (:mod:`quantkit.producers.legacy`) all read the choice from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quantkit.errors import UsageError
from quantkit.formats.names import Method
from quantkit.formats.specs import (DEFAULT_GROUP_SIZE, FALLBACK_GROUP_SIZES, TARGET_BITS_GROUP_FROM,
                                    TARGET_BITS_GROUP_SIZE, W4A8_GROUP_SIZE)

if TYPE_CHECKING:
    from quantkit.source import SourceModel


def grouped(spec: Any) -> bool:
    """Whether the spec's method takes a group size that a recipe may leave unset, for :func:`group_choice` to
    choose (awq, gptq, rtn, autoround): read off the spec class's ``group_size`` field (optional there), so no
    second list of method names exists. W4A8's group size is a fixed ``Literal``, checked by :func:`check_tiles`."""
    size = type(spec).model_fields.get("group_size")
    return size is not None and size.default is None


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
    raise to int8 and still scores lower: at 5.53 bits on SmolLM2-135M, 47 of 120 groups at int8 and an exact KLD of
    0.0293, against 66 and 0.0370 at group 64 symmetric (bench/results/h200/bits_g32a/). At 5.0 bits the two were
    level, so lower targets keep the plain default."""
    return (spec.method == Method.GPTQ and getattr(spec, "target_bits", None) is not None
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
    if not grouped(spec):
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


def check_tiles(spec: Any, source: SourceModel) -> None:
    """Refuse the two schemes whose tiles are fixed at 128 on widths 128 does not divide: there is no other size to
    choose, and vLLM would refuse the artifact only after loading it.

    * W4A8: llm-compressor's W4AFP8 scheme groups 128 weights, and vLLM 0.26's one W4A8 kernel on Hopper
      (``CutlassW4A8LinearKernel.can_implement``) takes group 128 with every layer's input and output width (per
      GPU) a multiple of 128.
    * FP8 block: 128x128 weight blocks with activations quantized in groups of 128 along each layer's input, and
      vLLM's block-scaled kernels need whole blocks along the input (compressed-tensors' ``initialize`` says so).
      The output rows may end in a partial block, so only the input widths are checked.
    """
    if spec.method == Method.W4A8:
        what = (f"w4a8 quantizes in groups of {W4A8_GROUP_SIZE} (the only size its scheme and vLLM's CUTLASS W4A8 "
                "kernel take)")
        widths = {**input_widths(source.config), **_fused_output_widths(source.config)}
        hint = "use awq, gptq or rtn (W4A16: they choose a group size that divides) or fp8"
    elif spec.method == Method.FP8 and spec.scheme == "block":
        what = "--scheme block quantizes in 128x128 weight blocks and activation groups of 128 along each layer's input"
        widths = input_widths(source.config)
        hint = "use --scheme dynamic (per-channel weights, per-token activations) or static: they take any width"
    else:
        return
    bad = [f"{k} = {v}" for k, v in widths.items() if v % 128]
    if bad:
        raise UsageError(f"{what}, and 128 does not divide the layers' width ({', '.join(bad)})", hint=hint)


def narrow_layers(spec: Any, source: SourceModel, ignore: list[str]) -> dict[str, int]:
    """The layers an FP4 spec keeps unquantized because their input width is not a whole number of its groups (16
    for NVFP4, 32 for MXFP4, fixed by the format: no other size to fall back to), by name with their width, read from
    the checkpoint's safetensors headers before anything loads. Empty for every other spec.

    llm-compressor 0.14 refuses such a layer when it initialises the scheme, and compressed-tensors could not pack
    it, so keeping it in the source's precision (added to the ignore list, said and recorded by the producer) is the
    one way to make the rest. Refused (exit 2) where that cannot work: when it would leave nothing to quantize, or
    would keep an expert of a mixture-of-experts model (every expert must be quantized:
    :mod:`quantkit.producers.coverage`)."""
    from quantkit import ignore as ignore_mod
    from quantkit.formats.specs import Fp4Spec
    from quantkit.producers import moe

    if not isinstance(spec, Fp4Spec):
        return {}
    targets = ignore_mod.targets(source, ignore)
    narrow = {n: w for n, w in sorted(targets.items()) if w % spec.group_size}
    what = f"{spec.method} quantizes in groups of {spec.group_size} along each layer's input"
    if narrow and len(narrow) == len(targets):
        raise UsageError(f"{what}, and no layer's input width is a multiple of {spec.group_size} "
                         f"({_shown(narrow)}): nothing would be quantized",
                         hint="use gptq or rtn: int4 in groups that divide the widths, or one scale per channel")
    fam = moe.family(source.config)
    experts = [n for n in narrow if fam and f".{fam.experts.rsplit('.', 1)[-1]}." in n]
    if experts:
        raise UsageError(f"{what}, and the input width of {len(experts)} expert projections is not a multiple of "
                         f"{spec.group_size} ({_shown({n: narrow[n] for n in experts})}); every expert of a "
                         "mixture-of-experts model must be quantized",
                         hint="use gptq or rtn (int4 in groups that divide the widths) or fp8")
    return narrow


def check_ignore(spec: Any, source: SourceModel, ignore: list[str]) -> None:
    """Refuse (exit 2, before anything loads) an effective ignore list the run could only fail on after all its
    work, for every method: one that leaves nothing to quantize (llm-compressor would write no quantization config),
    one that keeps an expert of a mixture-of-experts model in full precision (every expert must be quantized: the
    coverage check, :mod:`quantkit.producers.coverage`, fails the run after quantizing otherwise), and one that keeps
    part of a group of layers vLLM fuses (q/k/v, gate/up: :data:`quantkit.producers.mixed.FUSED`): vLLM refuses to
    load such a compressed-tensors checkpoint ("vLLM requires all to use the same scheme"), and for NVFP4, whose
    fused layers share one global scale, llm-compressor fails on it with an assertion once the model is loaded."""
    from quantkit import ignore as ignore_mod

    if not ignore_mod.targets(source, ignore):
        raise UsageError(f"the ignore list ({', '.join(ignore)}) keeps every layer of {source.spec} in full "
                         "precision: nothing would be quantized",
                         hint="narrow or drop the --ignore patterns (quantize.ignore)")
    names = ignore_mod.module_names(source)
    caught = [n for n in _expert_names(source, names) if any(ignore_mod.matches(p, n) for p in ignore)]
    if caught:
        more = f" (+{len(caught) - 3} more)" if len(caught) > 3 else ""
        raise UsageError(f"the ignore list keeps {len(caught)} expert projection(s) in full precision "
                         f"({', '.join(caught[:3])}{more}); every expert of a mixture-of-experts model must be "
                         "quantized",
                         hint="narrow or drop the --ignore patterns that catch experts (quantize.ignore)")
    _check_fused(names, ignore, spec.method)


def _expert_names(source: SourceModel, names: list[str]) -> list[str]:
    """The expert projections a run must quantize: by the names the loaded model has them under (llm-compressor's
    linearized ``mlp.experts.N.gate_proj``, which ignore patterns are matched against in the run), and by the
    checkpoint's own (Mixtral's ``block_sparse_moe.experts.N.w1``, which the ignore check accepts). Empty for a
    dense model."""
    from quantkit.producers import moe

    fam = moe.family(source.config)
    if fam is None:
        return []
    prefixes = sorted({n.partition(".layers.")[0] + ".layers" for n in names if ".layers." in n})
    loaded = [n for prefix in prefixes for ns in moe.expert_modules(fam, source.config, prefix).values() for n in ns]
    return list(dict.fromkeys(loaded + [n for n in names if ".experts." in n]))


def _check_fused(names: list[str], ignore: list[str], method: str) -> None:
    """Refuse an ignore list that keeps some, not all, of a fused group, naming the siblings to keep with them."""
    from quantkit import ignore as ignore_mod
    from quantkit.producers.mixed import FUSED

    present = set(names)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED if leaf in g), ())
        members = [f"{parent}.{x}" for x in group if f"{parent}.{x}" in present]
        if not members or members[0] != name:
            continue  # not in a fused group, or not its first member (each group is looked at once)
        kept = [m for m in members if any(ignore_mod.matches(p, m) for p in ignore)]
        if kept and len(kept) < len(members):
            rest = [m for m in members if m not in kept]
            why = (f"nvfp4 gives the layers vLLM fuses ({'/'.join(group)}) one global scale" if method == Method.NVFP4
                   else f"vLLM fuses {'/'.join(group)} into one layer and refuses a checkpoint whose parts differ")
            raise UsageError(f"the ignore list keeps {', '.join(kept)} in full precision but not {', '.join(rest)}: "
                             f"{why}, so they are quantized or kept together",
                             hint=f"ignore them together ({' '.join(f'--ignore {m}' for m in members)}), or none")


@dataclass(frozen=True)
class Checked:
    """What the compressed-tensors producer's check decided from the source, carried to its ``produce`` as
    ``ctx.checked`` so each is decided once: the group choice (None for a method without one) and the layers an FP4
    spec keeps for their width (:func:`narrow_layers`, which reads every safetensors header)."""

    choice: GroupChoice | None
    narrow: dict[str, int] = field(default_factory=dict)


def narrow_note(spec: Any, narrow: dict[str, int]) -> str:
    """The one line that says which layers :func:`narrow_layers` keeps (the warning, and the manifest's note; the
    full list is in the manifest's ignore list)."""
    return (f"kept unquantized (in the source's precision): {len(narrow)} layers whose input width is not a multiple "
            f"of {spec.method}'s group of {spec.group_size}: {_shown(narrow)}")


def _shown(widths: dict[str, int], n: int = 3) -> str:
    """The first few layers with their widths, for a one-line message."""
    more = f" (+{len(widths) - n} more)" if len(widths) > n else ""
    return ", ".join(f"{k}: {v}" for k, v in list(widths.items())[:n]) + more
