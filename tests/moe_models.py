"""Small random mixture-of-experts checkpoints of each family, in either expert layout, for tests.

``make_moe(family, path)`` writes a bf16 checkpoint with transformers' own ``save_pretrained`` and the reference
tokenizer (``models/quantkit-tiny``), so it loads like a real one in transformers, quantkit and the quantizers:

* ``qwen3moe``: ``Qwen3MoeForCausalLM`` (softmax router, top-k renormalised, q/k norms);
* ``mixtral``: ``MixtralForCausalLM`` (the hub's ``block_sparse_moe.experts.<i>.w1`` names);
* ``deepseek3``: ``DeepseekV3ForCausalLM`` (MLA attention, one leading dense layer, a shared expert, sigmoid
  routing with a non-zero score-correction bias, group-limited choice, routed scaling).

``fused=False`` writes one 2-D tensor per expert, as the hub publishes and as transformers 5.17's
``save_pretrained`` writes by default; ``fused=True`` writes the fused 3-D ``experts.gate_up_proj`` /
``experts.down_proj`` tensors transformers 5 holds in memory (``save_original_format=False``).

Every quantized row length is a multiple of 256 (hidden 256, expert and dense intermediate sizes 256/512, MLA
ranks 256), so group quantization (128) and GGUF K-quants (256) take every weight without a fallback, except
where a head-sized row is inherent (64-wide MLA k_b rows). Weights are drawn with a larger spread than
transformers' default, so router choices and next-token predictions are not near-ties, and a 2-layer model
of 8 experts runs a 2,048-token forward pass on a CPU in well under a second.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "quantkit-tiny"
FAMILIES = ("qwen3moe", "mixtral", "deepseek3")
ROUTER_SCALE = 4.0

_COMMON = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=8192, bos_token_id=0,
               eos_token_id=1, pad_token_id=1, max_position_embeddings=2048, initializer_range=0.1,
               rms_norm_eps=1e-6, tie_word_embeddings=False)


def _config(family: str, experts: int, layers: int, top_k: int, expert_ffn: int) -> Any:
    import transformers

    if family == "qwen3moe":
        return transformers.Qwen3MoeConfig(**_COMMON, head_dim=64, num_hidden_layers=layers, num_experts=experts,
                                           num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                                           intermediate_size=2 * expert_ffn, norm_topk_prob=True)
    if family == "mixtral":
        return transformers.MixtralConfig(**_COMMON, head_dim=64, num_hidden_layers=layers,
                                          num_local_experts=experts, num_experts_per_tok=top_k,
                                          intermediate_size=expert_ffn, sliding_window=None)
    if family == "deepseek3":
        groups = 4 if experts % 4 == 0 and experts >= 8 else 1
        return transformers.DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=layers, first_k_dense_replace=1,
            intermediate_size=2 * expert_ffn, moe_intermediate_size=expert_ffn, n_routed_experts=experts,
            num_experts_per_tok=top_k, n_shared_experts=1, n_group=groups, topk_group=max(1, groups // 2),
            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=256, kv_lora_rank=256,
            qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
    raise ValueError(f"unknown MoE family {family!r}; choose from {', '.join(FAMILIES)}")


def make_moe(family: str, path: Path, *, fused: bool = False, experts: int = 8, layers: int = 2, top_k: int = 2,
             expert_ffn: int = 256, seed: int = 0, tokenizer_from: Path = TINY, **overrides: Any) -> Path:
    """Write a random ``family`` checkpoint (one of :data:`FAMILIES`) to ``path`` and return ``path``.

    ``overrides`` are config fields (``norm_topk_prob=False``, ``tie_word_embeddings=True`` ...), applied after
    the defaults above. The same arguments give the same weights.
    """
    import torch
    import transformers

    config = _config(family, experts, layers, top_k, expert_ffn)
    if family == "deepseek3":  # as DeepSeek's config.json says (transformers' config class does not write it)
        config.scoring_func, config.topk_method = "sigmoid", "noaux_tc"
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a confident router: few choices are near-ties
                param.mul_(ROUTER_SCALE)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init; make the choosing-only bias matter
                buf.copy_(torch.rand(buf.shape) * 0.2)
    model.to(torch.bfloat16).save_pretrained(path, save_original_format=not fused)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / f, Path(path) / f)
    return Path(path)
