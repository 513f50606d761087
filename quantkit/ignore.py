"""Which modules stay in full precision: the defaults, the user's additions, and proof that each one exists.

``--ignore`` (recipe ``ignore:``) *adds* to the defaults, it never replaces them: a user who keeps one extra
layer in bf16 must not get an int4 ``lm_head`` as a side effect. The defaults are ``lm_head`` and, in
mixture-of-experts models, the router gates and shared-expert gates (quantizing a router changes which experts
every token goes to); ``default_ignore: false`` (``--no-default-ignore``) turns them off. A vision-language model's
vision tower and projector (its family's parts in :mod:`quantkit.architectures`) are always kept, whatever
``default_ignore`` says: only its language model is quantized (:mod:`quantkit.producers.vision` checks it).

Every pattern the user gives must match at least one module of the source checkpoint, read from its safetensors
headers before any weight loads: a misspelt name is an error listing the nearest real names, never a pattern that
silently keeps nothing. Patterns are llm-compressor's: an exact module name, or ``re:`` and a regular expression
matched from the start of the name (one that does not compile is an error naming it and why, before it is matched);
ModelOpt (``method: trt``) takes shell wildcards instead (``*mlp.down_proj``). A bare class name (``Linear``, no
dots) names a module type, which headers cannot show, and is not checked.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterator

from quantkit.architectures import router_patterns, vision_language
from quantkit.errors import UsageError
from quantkit.formats.specs import MethodBase
from quantkit.source import SourceModel, safetensors_header

# Kept in full precision unless default_ignore is off (and the routers of an MoE family: quantkit.architectures).
ALWAYS = ("lm_head",)
# transformers 5 may save a layer's experts fused into 3-D tensors: one name per expert and projection then.
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",), "w13": ("w1", "w3"),
          "w2": ("w2",)}


def _modules(source: SourceModel) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight-carrying module of the checkpoint with its weight's shape, from the safetensors headers; a
    layer's fused expert tensor (transformers 5: experts x output x input) as one module per expert and projection."""
    for f in source.weight_files:
        if f.suffix != ".safetensors":
            continue
        header, _ = safetensors_header(f)
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            prefix, _, leaf = tensor.rpartition(".")
            shape = tuple(info.get("shape", ()))
            if leaf == "weight":
                yield prefix, shape
            elif ".experts" in tensor and leaf in _FUSED and len(shape) == 3:
                for i in range(shape[0]):
                    for proj in _FUSED[leaf]:
                        yield f"{prefix}.{i}.{proj}", shape[1:]


def module_names(source: SourceModel) -> list[str]:
    """Every weight-carrying module of the checkpoint, by name (fused expert tensors expanded per expert)."""
    return sorted({name for name, _ in _modules(source)})


def module_input_widths(source: SourceModel) -> dict[str, int]:
    """The input width of every module with a 2-D weight (Linear layers, embeddings), by name: what a weight group
    runs along."""
    return {name: shape[1] for name, shape in _modules(source) if len(shape) == 2}


def matches(pattern: str, name: str, *, wildcards: bool = False) -> bool:
    """Whether an ignore pattern names a module (llm-compressor's rules, or ModelOpt's wildcards)."""
    if wildcards:  # quantkit.producers.trt.worker disables the quantizers under "*{pattern}.*"
        return fnmatch.fnmatchcase(name + ".", f"*{pattern}.*")
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def _is_class_name(pattern: str) -> bool:
    return not pattern.startswith("re:") and "." not in pattern and pattern[:1].isupper()


def effective(spec: MethodBase, source: SourceModel, *, wildcards: bool = False) -> list[str]:
    """The ignore list a producer passes on: the defaults that apply to this model, then the user's patterns.

    Raises :class:`UsageError` (exit 2) naming the nearest module names when a user pattern matches nothing."""
    names = module_names(source)
    defaults: list[str] = []
    if spec.default_ignore:
        defaults = list(ALWAYS) + router_patterns(source.config)
        if wildcards:
            defaults = [p if not p.startswith("re:") else _as_wildcard(p) for p in defaults]
    vl = vision_language(source.config)
    if vl is not None:
        defaults += [f"*{part}.*" for part in vl.keep] if wildcards else vl.ignore_patterns()
    for pattern in spec.ignore:
        if _is_class_name(pattern) or pattern in ALWAYS:
            continue
        if not wildcards:
            _check_regex(pattern)
        if not any(matches(pattern, n, wildcards=wildcards) for n in names):
            probe = pattern[3:] if pattern.startswith("re:") else pattern
            near = difflib.get_close_matches(probe.replace("*", ""), names, n=5, cutoff=0.4) or names[:5]
            raise UsageError(f"--ignore {pattern!r} matches no module of {source.spec}; nearest: {', '.join(near)}",
                             hint="use a module name from the checkpoint, or re:REGEX"
                                  + (" (shell wildcards for method trt: '*mlp.down_proj')" if wildcards else ""))
    return list(dict.fromkeys(defaults + list(spec.ignore)))


# A weight-carrying module that is an embedding (its "input width" is no Linear's): never a quantization target.
EMBEDDINGS = ("embed", "wte", "wpe")


def targets(source: SourceModel, ignore: list[str]) -> dict[str, int]:
    """The Linear layers a compressed-tensors method would quantize with this ignore list, by name with their input
    width, from the headers: every 2-D weight that is no embedding and that no pattern names. A bare class name
    (``Linear``) is not seen here (headers show no types)."""
    return {n: w for n, w in module_input_widths(source).items()
            if not any(matches(p, n) for p in ignore) and not any(e in n.rpartition(".")[2] for e in EMBEDDINGS)}


def _check_regex(pattern: str) -> None:
    """Refuse a ``re:`` pattern that is no regular expression, naming it and what is wrong (llm-compressor would
    fail on it after the model loaded; matching it here would be a traceback)."""
    if not pattern.startswith("re:"):
        return
    try:
        re.compile(pattern[3:])
    except re.error as e:
        raise UsageError(f"--ignore {pattern!r} is not a valid regular expression: {e}",
                         hint="escape characters that are literal (re:model\\.layers\\.0\\.mlp\\.down_proj) or "
                              "give the exact module name") from None


def _as_wildcard(regex_pattern: str) -> str:
    """A default MoE gate pattern in ModelOpt's wildcard syntax (``re:.*\\.mlp\\.gate$`` -> ``*.mlp.gate``)."""
    return "*" + regex_pattern[3:].removeprefix(".*").replace("\\.", ".").removesuffix("$")
