"""What quantkit does with mixture-of-experts models: llm-compressor's MoE work, and the router statistics.

Each family's routers, experts and checkpoint names are rows of the architecture table
(:class:`quantkit.architectures.MoeFamily`); this module is what the compressed-tensors producer does with them.

llm-compressor does the MoE work itself: its linear experts hold one ``nn.Linear`` per expert projection, built at
load from a checkpoint that stores one tensor per expert (:func:`load_linearized`) or replacing transformers 5's
fused 3-D expert weights after the load (block by block, :func:`linearize`), and
``oneshot(moe_calibrate_all_experts=True)`` runs every expert on every calibration token (while keeping the
router's output), so no expert is calibrated on nothing. What it does not do, and this module does from the
family's row, is say for each family

* which modules are the routers (and shared-expert gates), which must never be quantized (:func:`router_patterns`);
* which expert projections must all come out quantized, layer by layer (:func:`expert_modules`; the coverage
  check in :mod:`quantkit.producers.coverage` uses them);
* how the checkpoint names its experts, where llm-compressor's linearized names differ from what vLLM and
  transformers read (Mixtral's ``block_sparse_moe.experts.N.w1``: :func:`save_as_checkpoint`);
* how many calibration tokens the *real* router sent to each expert (:class:`RouterTokens`), which
  ``calibrate_all_experts`` hides: an expert that is rarely chosen on the calibration data still gets scales,
  but from tokens that were routed elsewhere.

Tested with transformers 5.17.0 and llmcompressor 0.14.0.1.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from quantkit import versions
from quantkit.architectures import MoeFamily as Family, moe_family as family, router_patterns, vision_language

__all__ = ["Family", "RouterTokens", "awq_mappings", "expert_modules", "family", "image_aliases_hidden", "layer_prefix",
           "linearize", "load_linearized", "loads_per_expert", "low_token_warning", "per_expert_checkpoint",
           "router_patterns", "save_as_checkpoint"]

# The transformers release whose class patching (``transformers.monkey_patching.apply_patches``) and image-processor
# aliases :func:`image_aliases_hidden` was read against; on another, :func:`load_linearized` is not used.
TRANSFORMERS_READ = "5.17.0"
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.")  # model.layers.1.mlp.experts.7.gate_proj.weight
_FUSED = re.compile(r"(?:^|\.)experts\.(?!\d)")  # model.layers.1.mlp.experts.gate_up_proj


_LAYER_PREFIXES = ("model.layers", "model.language_model.layers")


def layer_prefix(model: Any) -> str:
    """Where the decoder layers sit: ``model.layers``, or a VLM's ``model.language_model.layers``."""
    names = {name for name, _ in model.named_modules()}
    found = next((p for p in _LAYER_PREFIXES if p in names), None)
    if found is None:
        raise ValueError(f"no decoder layers at {' or '.join(_LAYER_PREFIXES)}")
    return found


def expert_modules(fam: Family, config: dict[str, Any], prefix: str) -> dict[int, list[str]]:
    """Per MoE layer, the name of every expert projection that must come out quantized."""
    return {i: [f"{prefix}.{i}.{fam.experts}.{e}.{p}" for e in range(fam.num_experts(config)) for p in fam.projections]
            for i in fam.layers(config)}


def linearize(model: Any) -> Any:
    """llm-compressor's ``linearize_moe``, one experts block at a time: each fused block is replaced and dropped
    before the next is copied.

    ``linearize_moe`` holds every fused block in a list until it returns, so the process briefly holds the experts
    twice (on Qwen3-30B-A3B's width, 12 layers: 41 GiB peak host RSS against llm-compressor's 21-24 GiB when it
    loads straight into per-expert Linears). Here the extra is one layer's experts. The modules and the weights
    they get are llm-compressor's own (``LinearExperts2D.from_experts_module``); ``oneshot`` finds nothing left to
    linearize.
    """
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    for name in [name for name, _ in get_non_linearized_moes(model)]:
        fused = model.get_submodule(name)
        linear = LinearExperts2D.get_linear_experts_cls(type(fused)).from_experts_module(
            fused, getattr(fused, "config", model.config))
        model.set_submodule(name, linear)
        del fused, linear
    return model


def per_expert_checkpoint(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names hold its routed experts one tensor per expert projection
    (``experts.N.gate_proj.weight``, as the hub publishes Qwen-MoE and DeepSeek) and none fused 3-D
    (``experts.gate_up_proj``, what transformers 5 holds in memory and writes with ``save_original_format=False``):
    only such a checkpoint can fill llm-compressor's per-expert Linears as they are built (:func:`load_linearized`);
    a fused one loads plainly and is linearized after."""
    names = list(names)
    return any(_PER_EXPERT.search(n) for n in names) and not any(_FUSED.search(n) for n in names)


def loads_per_expert(config: dict[str, Any], per_expert: bool, trust_remote_code: bool = False) -> bool:
    """Whether the model's load builds this checkpoint straight into llm-compressor's per-expert Linears
    (:func:`load_linearized`, from :func:`quantkit.producers.oneshot.load_model`): a causal-LM family of the MoE
    table without custom code, a checkpoint whose headers hold one tensor per expert (``per_expert``:
    :func:`per_expert_checkpoint` of the headers each caller has read already), the transformers release that load
    was read against (:data:`TRANSFORMERS_READ`). Its experts then stay in the checkpoint's mapped pages; otherwise
    the plain load stacks them into 3-D tensors of the process's own memory, which the memory plan counts
    (:func:`quantkit.plan._memory` asks this too). Every family of the table has llm-compressor 0.14's load
    mapping."""
    return (not trust_remote_code and family(config) is not None and vision_language(config) is None
            and versions.version("transformers") == TRANSFORMERS_READ and per_expert)


@contextlib.contextmanager
def image_aliases_hidden() -> Iterator[None]:
    """transformers 5.17's backward-compatibility aliases (``models.X.image_processing_X_fast`` and the like), out of
    ``sys.modules`` while a model is built with a class patch registered, then put back.

    ``apply_patches`` lists every loaded ``transformers.*`` module with ``dir()``, and an alias's ``dir()`` imports
    the image processor it stands for, which imports torchvision: without it every patched load fails (with a
    CUDA-only torchvision too). The aliases hold no model classes, so the patching loses nothing by not seeing
    them."""
    hidden = {name: module for name, module in list(sys.modules.items()) if name.startswith("transformers.")
              and (getattr(module, "__doc__", None) or "").startswith("Alias module for backward compatibility")}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def load_linearized(auto: Any, src: str, model_type: str, **kwargs: Any) -> tuple[Any, dict[str, Any]] | None:
    """The model loaded straight into llm-compressor's per-expert Linears, with transformers' loading info; None
    where llm-compressor has no per-expert load mapping for the family: then the caller loads plainly and calls
    :func:`linearize`.

    For a checkpoint that stores one tensor per expert (:func:`loads_per_expert`, which the caller checks) the
    plain load stacks every layer's experts into new 3-D tensors and :func:`linearize` copies them apart again: on
    Qwen3-30B-A3B's width (2 layers, CPU) 13.0 s and 3.8 GiB of anonymous memory for a load that, built this way,
    takes 0.9 s and keeps the weights in the safetensors' mapped pages (bench/results/moe_load_qwen3-30b-a3b-2l.md).

    The pieces are llm-compressor's (the family's experts class, its per-expert Linear class, the load and save
    mappings: ``get_linearize_load_mappings``) and transformers' (class patching, conversion mappings), composed as
    its ``load_quantizable_moe`` composes them, because that context (a) drops ``output_loading_info`` (it sets an
    attribute on the returned tuple), and the missing keys are what make an absent expert weight an error here
    rather than a random initialisation, and (b) leaves the per-expert mapping registered for the model type, so a
    later plain load of the same family in this process would not stack its experts. Here both registrations are
    undone when the load returns, whatever it raised."""
    from llmcompressor.modeling.moe.conversion_mappings import (get_linearize_load_mappings,
                                                                has_linearize_load_mappings,
                                                                set_save_conversion_mapping)
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from transformers.conversion_mapping import (USER_REGISTERED_MAPPINGS, get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)
    from transformers.monkey_patching import register_patch_mapping, unregister_patch_mapping

    if not has_linearize_load_mappings(model_type):
        return None
    experts_cls, load_map, save_map = get_linearize_load_mappings(model_type)
    before = get_checkpoint_conversion_mapping(model_type)
    if experts_cls is None or before is None:
        return None
    user_registered = model_type in USER_REGISTERED_MAPPINGS  # which custom-code models share the mapping
    register_patch_mapping({experts_cls.__name__: LinearExperts2D.get_linear_experts_cls(experts_cls)})
    register_checkpoint_conversion_mapping(model_type, load_map, overwrite=True)
    try:
        with image_aliases_hidden():
            model, info = auto.from_pretrained(src, output_loading_info=True, **kwargs)
    finally:
        unregister_patch_mapping([experts_cls.__name__])
        register_checkpoint_conversion_mapping(model_type, before, overwrite=True)
        if not user_registered:
            USER_REGISTERED_MAPPINGS.discard(model_type)
    set_save_conversion_mapping(model, save_map)  # the checkpoint's per-expert names on save, as llm-compressor does
    return model, info


def save_as_checkpoint(model: Any, fam: Family) -> None:
    """Make ``save_pretrained`` write the family's checkpoint names for the linearized experts.

    llm-compressor's linearized experts are saved under their in-memory names (``mlp.experts.N.gate_proj``); for
    Mixtral neither vLLM nor transformers reads those (they expect ``block_sparse_moe.experts.N.w1``), so the experts
    would be silently missing when the artifact loads (llm-compressor issue #3069). transformers reverts the
    model's load-time renamings on save; these renamings, set with llm-compressor's own hook for that, write the
    checkpoint's names instead. Nothing to do for a family whose names already agree.
    """
    if not fam.checkpoint_block and not fam.checkpoint_projections:
        return
    from llmcompressor.modeling.moe.conversion_mappings import set_save_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    block = fam.experts.rsplit(".", 1)[0]
    renames = []
    if fam.checkpoint_block:
        renames.append(WeightRenaming(source_patterns=rf"\.{fam.checkpoint_block}\.", target_patterns=f".{block}."))
    renames += [WeightRenaming(source_patterns=rf"\.experts\.(\d+)\.{ckpt}\.", target_patterns=rf".experts.\1.{mem}.")
                for mem, ckpt in fam.checkpoint_projections.items()]
    set_save_conversion_mapping(model, renames)


def awq_mappings(model: Any, fam: Family, config: dict[str, Any]) -> list[Any] | None:
    """llm-compressor's AWQ mappings for the model, made to work when some decoder layers are dense; None when its
    own mappings work as they are.

    Its mapping that smooths the post-attention norm into the router and the experts' gate/up projections (the
    router must be rescaled with them, or routing shifts) cannot be matched on a dense layer, which has no router:
    llm-compressor 0.14.0.1 stops with "AWQ needs to match a single smoothlayer" on DeepSeek-V3, whose first
    ``first_k_dense_replace`` layers are dense. That mapping is split in two, scoped by layer index: the MoE layers
    keep it whole, the dense layers get it without the router. Every other mapping is theirs, unchanged.
    """
    from llmcompressor.modifiers.transform.awq import AWQMapping
    from llmcompressor.modifiers.transform.awq.dynamic_mappings import get_layer_mappings_from_model

    moe_layers = fam.layers(config)
    dense = [i for i in range(int(config["num_hidden_layers"])) if i not in moe_layers]
    mappings = get_layer_mappings_from_model(model)

    def router(pattern: str) -> bool:
        return pattern.replace("\\", "").endswith(fam.router + "$")

    if not dense or not any(router(b) for m in mappings for b in m.balance_layers):
        return None

    def scoped(pattern: str, layers: list[int]) -> str:
        return rf"re:.*layers\.({'|'.join(map(str, layers))})\..*" + pattern.removeprefix("re:").removeprefix(".*")

    out = []
    for m in mappings:
        if not any(router(b) for b in m.balance_layers):
            out.append(m)
            continue
        out.append(AWQMapping(scoped(m.smooth_layer, moe_layers), [scoped(b, moe_layers) for b in m.balance_layers]))
        out.append(AWQMapping(scoped(m.smooth_layer, dense),
                              [scoped(b, dense) for b in m.balance_layers if not router(b)]))
    return out


class RouterTokens:
    """Count, per MoE layer and expert, the calibration tokens the model's own router chose that expert for.

    A pre-forward hook on each layer's experts module reads ``top_k_index``: the router's top-k choice, which
    transformers 5 passes to every experts implementation (llm-compressor's linearized one included). With
    ``calibrate_all_experts`` every expert still computes every token, so this is the only place the real routing is
    visible. The counts are what the calibration pass routed: with llm-compressor 0.14.0.1's traced layers that pass
    runs without the causal mask (tests/test_moe_compressed.py), so they differ a little from what the router does
    at inference on the same text. Only the calibration pass is counted: llm-compressor disables its hooks
    (``HooksMixin``) for the propagation pass and for AWQ's scale search, and each layer stops counting once it has
    seen every calibration token once (a modifier that re-runs a layer adds nothing).
    """

    def __init__(self, model: Any, fam: Family, config: dict[str, Any], tokens: int) -> None:
        import torch

        self.tokens = tokens
        prefix = layer_prefix(model)
        self.counts = {i: torch.zeros(fam.num_experts(config), dtype=torch.long) for i in fam.layers(config)}
        self.seen = dict.fromkeys(self.counts, 0)
        self._modules = {i: model.get_submodule(f"{prefix}.{i}.{fam.experts}") for i in self.counts}
        self._handles: list[Any] = []

    def __enter__(self) -> "RouterTokens":
        for i, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Callable[..., None]:
        import torch
        from llmcompressor.modifiers.utils.hooks import HooksMixin

        def count(module: Any, args: tuple, kwargs: dict) -> None:
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if HooksMixin._HOOKS_DISABLED or not isinstance(index, torch.Tensor):
                return
            take = min(index.shape[0], self.tokens - self.seen[layer])
            if take > 0:
                chosen = index[:take].reshape(-1).to("cpu", torch.long)
                self.counts[layer] += torch.bincount(chosen, minlength=self.counts[layer].numel())
                self.seen[layer] += take

        return count

    def summary(self, threshold: int) -> dict[str, Any]:
        """The manifest's record: counts per layer (a list per layer, expert order), the minimum, the experts below
        ``threshold`` per layer, and whether every layer saw every calibration token."""
        per_layer = {str(i): c.tolist() for i, c in self.counts.items()}
        below = {str(i): [e for e, n in enumerate(c.tolist()) if n < threshold] for i, c in self.counts.items()}
        return {"calibration_tokens": self.tokens, "per_layer": per_layer,
                "min": min((min(c) for c in per_layer.values()), default=None),
                "threshold": threshold, "below_threshold": {k: v for k, v in below.items() if v},
                "complete": all(s == self.tokens for s in self.seen.values())}


def low_token_warning(stats: dict[str, Any], consequence: str) -> str | None:
    """One line for the reporter about experts the router rarely chose, or None when there are none.

    ``stats`` is :meth:`RouterTokens.summary`'s shape (``per_layer``, ``threshold``, ``below_threshold``), which the
    GGUF importance matrix's per-expert counts also take; ``consequence`` says what few tokens mean for the method.
    """
    below = stats["below_threshold"]
    if not below:
        return None
    n = sum(len(v) for v in below.values())
    counts = stats["per_layer"]
    where = "; ".join(f"layer {layer}: " + ", ".join(f"expert {e} got {counts[layer][e]}" for e in experts[:8])
                      + (f" and {len(experts) - 8} more" if len(experts) > 8 else "")
                      for layer, experts in list(below.items())[:4])
    more = f"; and {len(below) - 4} more layers" if len(below) > 4 else ""
    return (f"{n} expert(s) got fewer than {stats['threshold']} calibration tokens from the router ({where}{more}); "
            f"{consequence}: more or broader calibration data (--samples, --calib) would exercise them")
