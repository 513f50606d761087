"""Hyperparameters: a checkpoint's config -> the GGUF keys llama.cpp reads for its architecture.

The config is read through transformers' own config classes, so defaults a ``config.json`` leaves out, the
older ``rope_theta``/``rope_scaling`` spelling and the newer ``rope_parameters`` all come out the same way
transformers itself runs the model. Everything llama.cpp cannot reproduce (an unusual rope scaling, an attention
scale it hard-codes differently) is refused here, before any tensor is read, instead of converting into a model
that loads but computes something else.

Tested with gguf 0.19.0, transformers 5.17.0 and llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import SourceModelError
from quantkit.producers.gguf.families import Family


@dataclass
class Moe:
    """A mixture-of-experts network's routing, as llama.cpp's keys say it (see :class:`.families.Experts`)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int | None  # one expert's intermediate size, where the family writes it
    gating: str  # "softmax" or "sigmoid"
    norm: bool  # the chosen experts' weights are renormalised to sum to 1
    scale: float | None = None
    n_shared: int | None = None
    n_groups: int = 0  # 0: no group selection (or one that keeps every group)
    n_groups_used: int = 0
    n_dense_lead: int | None = None


@dataclass
class Mla:
    """Multi-head latent attention's ranks and head sizes (DeepSeek-V2/V3)."""

    q_lora_rank: int  # 0: q is projected directly (q_proj), without the low-rank pair
    kv_lora_rank: int
    qk_nope: int  # per head: the part of q/k without rope
    qk_rope: int  # per head: the part with rope (one rope key shared by all heads)
    v_head_dim: int


@dataclass
class HParams:
    """What the GGUF header says about the network (all values as llama.cpp expects them)."""

    n_ctx: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rms_eps: float
    n_vocab: int
    tied: bool
    rope_theta: float
    rope: dict[str, Any]  # transformers' rope parameters of the full-attention layers
    rope_theta_swa: float | None = None
    sliding_window: int | None = None
    swa_layers: list[bool] | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    moe: Moe | None = None
    mla: Mla | None = None
    query_pre_attn_scalar: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def rope_type(self) -> str:
        return str(self.rope.get("rope_type") or self.rope.get("type") or "default")


def load_config(path: Path) -> Any:
    """The checkpoint's config through transformers (no weights, no remote code)."""
    from quantkit import versions

    transformers = versions.require("transformers", "gguf", "Reading the model config for GGUF conversion")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise SourceModelError(f"transformers cannot read {path}/config.json: {e}",
                               hint="check the checkpoint, or upgrade transformers for a newer architecture") from None


def _rope_for(cfg: Any, layer_type: str) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        return dict(params[layer_type])
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(next(iter(params.values())))
    out = dict(params)
    if "rope_theta" not in out and getattr(cfg, "rope_theta", None) is not None:
        out["rope_theta"] = cfg.rope_theta
    return out


def from_config(cfg: Any, family: Family) -> HParams:
    """Collect and check the hyperparameters; raises :class:`SourceModelError` for what llama.cpp cannot do."""
    n_head = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head)
    rope = _rope_for(cfg, "full_attention")
    partial = float(rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1.0)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    hp = HParams(
        n_ctx=int(cfg.max_position_embeddings), n_embd=int(cfg.hidden_size), n_layer=int(cfg.num_hidden_layers),
        n_ff=int(cfg.intermediate_size), n_head=n_head,
        n_head_kv=int(getattr(cfg, "num_key_value_heads", None) or n_head), head_dim=head_dim,
        n_rot=int(head_dim * partial), rms_eps=float(cfg.rms_norm_eps), n_vocab=int(cfg.vocab_size),
        tied=family.always_tied or bool(getattr(cfg, "tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", 10000.0)), rope=rope,
    )
    if family.sliding_window and getattr(cfg, "sliding_window", None):
        hp.sliding_window = int(cfg.sliding_window)
        hp.swa_layers = [t == "sliding_attention" for t in layer_types] or None
    if family.swa_rope_base:
        hp.rope_theta_swa = float(_rope_for(cfg, "sliding_attention").get("rope_theta", 10000.0))
    if family.softcapping:
        hp.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
        hp.final_softcap = getattr(cfg, "final_logit_softcapping", None)
    elif getattr(cfg, "final_logit_softcapping", None):
        hp.final_softcap = float(cfg.final_logit_softcapping)
    if family.experts is not None:
        hp.moe = _moe(cfg, family)
    if family.mla:
        hp.mla = Mla(q_lora_rank=int(cfg.q_lora_rank or 0), kv_lora_rank=int(cfg.kv_lora_rank),
                     qk_nope=int(cfg.qk_nope_head_dim), qk_rope=int(cfg.qk_rope_head_dim),
                     v_head_dim=int(cfg.v_head_dim))
    if family.fixed_attention_scale:
        hp.query_pre_attn_scalar = getattr(cfg, "query_pre_attn_scalar", None)
    _check(hp, family, cfg)
    return hp


def _moe(cfg: Any, family: Family) -> Moe:
    """The routing from the config, through the keys the family's row names."""
    ex = family.experts
    assert ex is not None
    moe = Moe(n_expert=int(getattr(cfg, ex.count_key)), n_expert_used=int(getattr(cfg, ex.used_key)),
              n_ff_exp=int(getattr(cfg, ex.ffn_key)) if ex.ffn_key else None, gating=ex.gating,
              norm=bool(getattr(cfg, ex.norm_key)) if ex.norm_key else True)
    if ex.scale_key:
        moe.scale = float(getattr(cfg, ex.scale_key) or 1.0)
    if ex.shared_key:
        moe.n_shared = int(getattr(cfg, ex.shared_key) or 0)
    if ex.groups:
        groups, used = (int(getattr(cfg, k) or 1) for k in ex.groups)
        if used < groups:  # keeping every group is no selection at all, and llama.cpp asserts used < groups
            moe.n_groups, moe.n_groups_used = groups, used
    if ex.dense_lead_key:
        moe.n_dense_lead = int(getattr(cfg, ex.dense_lead_key) or 0)
    return moe


def _check(hp: HParams, family: Family, cfg: Any) -> None:
    name = family.label
    quantized = getattr(cfg, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        raise SourceModelError(
            f"{name}: the checkpoint is already quantized ({method}); GGUF conversion reads unquantized weights",
            hint="convert an unquantized (bf16, fp16 or fp32) copy of the model, e.g. DeepSeek-V3's FP8 weights "
                 "cast to bf16")
    if hp.rope_type not in family.rope_types:
        raise SourceModelError(
            f"{name}: rope scaling {hp.rope_type!r} is not supported by the GGUF converter "
            f"(supported for this family: {', '.join(family.rope_types)})",
            hint="convert with llama.cpp's convert_hf_to_gguf.py, which knows more rope variants")
    if family.rope_permute and hp.n_rot != hp.head_dim:
        raise SourceModelError(f"{name}: partial rotary embeddings are not supported for the llama architecture")
    if family.fixed_attention_scale and hp.query_pre_attn_scalar is not None:
        expected = hp.n_embd / hp.n_head if hp.n_layer == 46 else hp.head_dim
        if abs(float(hp.query_pre_attn_scalar) - expected) > 1e-6:
            raise SourceModelError(
                f"{name}: query_pre_attn_scalar is {hp.query_pre_attn_scalar}, but llama.cpp hard-codes the "
                f"attention scale to 1/sqrt({expected:g}) for this shape; the GGUF would compute different logits",
                hint="only checkpoints whose query_pre_attn_scalar equals head_dim (hidden/heads for 27B) convert")
    if family.gguf_arch == "LLAMA" and getattr(cfg, "sliding_window", None) and cfg.sliding_window < hp.n_ctx:
        hp.notes.append(f"sliding_window {cfg.sliding_window} is not used by llama.cpp's llama architecture: "
                        f"contexts beyond {cfg.sliding_window} tokens attend to the full context")
    if hp.sliding_window and hp.swa_layers is not None and len(hp.swa_layers) != hp.n_layer:
        raise SourceModelError(f"{name}: layer_types has {len(hp.swa_layers)} entries for {hp.n_layer} layers")
    if hp.rope_type == "yarn":
        _check_yarn(hp, family)
    if hp.moe is not None:
        _check_moe(hp.moe, family, cfg)
    if hp.mla is not None:
        _check_mla(family, cfg)


def _check_yarn(hp: HParams, family: Family) -> None:
    """YaRN as llama.cpp's deepseek2 graph computes it (the one family whose row allows yarn): ramp bounds 32/1 (truncated), no explicit attention
    factor, and ``mscale`` equal to ``mscale_all_dim``, which then scales the attention logits by
    (0.1 * mscale_all_dim * ln(factor) + 1)^2 and leaves cos/sin alone, as transformers does."""
    r = hp.rope
    differs = {k: r.get(k) for k, ok in (("beta_fast", r.get("beta_fast") in (None, 32)),
                                         ("beta_slow", r.get("beta_slow") in (None, 1)),
                                         ("truncate", r.get("truncate", True) is True),
                                         ("attention_factor", r.get("attention_factor") is None),
                                         ("mscale", bool(r.get("mscale_all_dim"))
                                          and r.get("mscale") == r.get("mscale_all_dim"))) if not ok}
    if differs:
        raise SourceModelError(
            f"{family.label}: llama.cpp's YaRN for this architecture cannot reproduce rope parameters {differs} "
            f"(it needs beta_fast 32, beta_slow 1, truncation, no attention_factor, and mscale equal to a non-zero "
            f"mscale_all_dim); the GGUF would compute different attention",
            hint="serve this checkpoint with an engine that follows transformers' rope parameters (vLLM), or "
                 "choose another quantization method")


def _check_moe(moe: Moe, family: Family, cfg: Any) -> None:
    """Refuse routing llama.cpp's graph for this architecture would compute differently."""
    name, arch = family.label, family.gguf_arch.lower()
    hint = "convert it with llama.cpp's own convert_hf_to_gguf.py if it supports this variant, or use another method"
    assert family.experts is not None
    if not moe.norm and not family.experts.norm_in_file:
        raise SourceModelError(
            f"{name}: {family.experts.norm_key} is false, but llama.cpp's {arch} architecture always renormalises "
            f"the chosen experts' weights; the GGUF would route differently from transformers", hint=hint)
    dense = list(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", None) or 1)
    if family.experts.dense_lead_key is None and (dense or step != 1):
        raise SourceModelError(
            f"{name}: not every layer has experts (mlp_only_layers {dense}, decoder_sparse_step {step}), but "
            f"llama.cpp's {arch} architecture expects experts in every layer", hint=hint)
    if not 0 < moe.n_expert_used <= moe.n_expert:
        raise SourceModelError(f"{name}: {moe.n_expert_used} experts per token out of {moe.n_expert}",
                               hint="the checkpoint's config is inconsistent")
    if moe.n_groups and moe.n_expert % moe.n_groups:
        raise SourceModelError(f"{name}: {moe.n_expert} experts do not split into {moe.n_groups} equal groups",
                               hint="the checkpoint's config is inconsistent")


def _check_mla(family: Family, cfg: Any) -> None:
    """llama.cpp's MLA graph has no attention biases and rotates interleaved pairs (DeepSeek's own layout)."""
    name = family.label
    if getattr(cfg, "attention_bias", False):
        raise SourceModelError(f"{name}: attention_bias is true, but llama.cpp's MLA attention has no biases",
                               hint="only checkpoints without attention biases convert")
    if not getattr(cfg, "rope_interleave", True):
        raise SourceModelError(
            f"{name}: rope_interleave is false (rotate-half rope), but llama.cpp rotates the interleaved pairs of "
            f"DeepSeek's own layout; the GGUF would compute different logits",
            hint="only checkpoints with rope_interleave true (as DeepSeek publishes them) convert")


def llama3_rope_factors(hp: HParams) -> list[float]:
    """Per-frequency divisors for Llama 3.1's rope scaling (llama.cpp's ``rope_freqs`` tensor).

    Frequencies whose wavelength is short stay; long ones are divided by ``factor``; the band between is
    interpolated smoothly, as in the Llama 3.1 reference implementation.
    """
    r = hp.rope
    factor = float(r["factor"])
    low, high = float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old_ctx = float(r.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, hp.n_rot, 2):
        freq = 1.0 / (hp.rope_theta ** (i / hp.n_rot))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def write(writer: Any, hp: HParams, family: Family, *, name: str, file_type: int) -> None:
    """Add the architecture's hyperparameter keys to a :class:`gguf.GGUFWriter`."""
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    if hp.mla is not None:  # llama.cpp's absorbed MLA: one latent head of kv_lora_rank (+ the shared rope key)
        writer.add_head_count_kv(1)
        writer.add_key_length(hp.mla.kv_lora_rank + hp.mla.qk_rope)
        writer.add_value_length(hp.mla.kv_lora_rank)
    else:
        writer.add_head_count_kv(hp.n_head_kv)
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_rope_dimension_count(hp.n_rot)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(hp.n_vocab)
    if hp.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(hp.rope["factor"]))
    if hp.rope_type == "yarn":  # llama.cpp's deepseek2 reads the multiplier as 0.1 * mscale_all_dim
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(hp.rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(hp.rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(hp.rope["mscale_all_dim"]))
    if hp.moe is not None:
        _write_moe(writer, hp.moe, family)
    if hp.mla is not None:
        _write_mla(writer, hp)
    if hp.sliding_window:
        writer.add_sliding_window(hp.sliding_window)
        if hp.swa_layers is not None:
            writer.add_sliding_window_pattern(hp.swa_layers)
    if hp.rope_theta_swa is not None:
        writer.add_rope_freq_base_swa(hp.rope_theta_swa)
    if hp.attn_softcap:
        writer.add_attn_logit_softcapping(float(hp.attn_softcap))
    if hp.final_softcap:
        writer.add_final_logit_softcapping(float(hp.final_softcap))


def _write_moe(writer: Any, moe: Moe, family: Family) -> None:
    import gguf

    writer.add_expert_count(moe.n_expert)
    writer.add_expert_used_count(moe.n_expert_used)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType[moe.gating.upper()])
    if moe.n_ff_exp is not None:
        writer.add_expert_feed_forward_length(moe.n_ff_exp)
    if family.experts is not None and family.experts.norm_in_file:
        writer.add_expert_weights_norm(moe.norm)
    if moe.scale is not None:
        writer.add_expert_weights_scale(moe.scale)
    if moe.n_shared is not None:
        writer.add_expert_shared_count(moe.n_shared)
    if moe.n_groups:
        writer.add_expert_group_count(moe.n_groups)
        writer.add_expert_group_used_count(moe.n_groups_used)
    if moe.n_dense_lead is not None:
        writer.add_leading_dense_block_count(moe.n_dense_lead)


def _write_mla(writer: Any, hp: HParams) -> None:
    """The ranks, and the per-head sizes before absorption (the attention scale is 1/sqrt(qk_nope + qk_rope))."""
    mla = hp.mla
    assert mla is not None
    writer.add_q_lora_rank(mla.q_lora_rank)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    writer.add_key_length_mla(mla.qk_nope + mla.qk_rope)
    writer.add_value_length_mla(mla.v_head_dim)
