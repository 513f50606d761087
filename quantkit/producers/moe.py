"""What quantkit does with mixture-of-experts models: llm-compressor's MoE work, and the router statistics.

Each family's routers, experts and checkpoint names are rows of the architecture table
(:class:`quantkit.architectures.MoeFamily`); this module is what the compressed-tensors producer does with them.

llm-compressor does the MoE work itself: its linear experts replace transformers 5's fused 3-D expert weights with
one ``nn.Linear`` per expert projection (block by block, :func:`linearize`), and
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

from collections.abc import Callable
from typing import Any

from quantkit.architectures import MoeFamily as Family, moe_family as family, router_patterns

__all__ = ["Family", "RouterTokens", "awq_mappings", "expert_modules", "family", "layer_prefix", "linearize",
           "low_token_warning", "router_patterns", "save_as_checkpoint"]


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
