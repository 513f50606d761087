"""Checkpoints llama.cpp's converter takes but converts wrong: refused before any work, each one measured.

llama.cpp's ``convert_hf_to_gguf.py`` (b11312) converts these configurations without a word, and the file then
computes other logits than transformers (F32 GGUF against transformers in float32, 512 held-out tokens, random
2-layer checkpoints of ``tests/moe_models.py``; ``tests/test_gguf_moe.py`` repeats every case):

* Qwen3-MoE with ``norm_topk_prob`` false: llama.cpp's qwen3moe graph always renormalises the chosen experts'
  weights (top-1 agreement 0.945, largest logit difference 2.75);
* DeepSeek-V3 with ``rope_interleave`` false: llama.cpp rotates the interleaved pairs of DeepSeek's own layout
  (top-1 0.002);
* DeepSeek-V3 with ``attention_bias`` true: llama.cpp's MLA attention has no biases; the file does not load;
* DeepSeek-V3 YaRN with ``mscale`` other than ``mscale_all_dim``: llama.cpp's deepseek2 graph scales attention by
  ``mscale_all_dim`` alone (top-1 0.40).
* DeepSeek-V3 without ``scoring_func`` in config.json (DeepSeek's own says ``sigmoid``; transformers' config class
  does not write it): the converter then writes no ``expert_gating_func``, llama.cpp gates with softmax, while
  transformers' DeepSeek-V3 always uses sigmoid (top-1 0.43).
* Gemma 3 whose ``layer_types`` are not llama.cpp's fixed pattern (every sixth layer full attention, the rest
  sliding; the converter writes no pattern): a 2-layer sliding/full checkpoint differs by 2.44 in its logits
  (tests/test_gguf.py, before its Gemma 3 case took the real pattern).

What upstream gets right where quantkit's own converter refused (Qwen3-MoE with YaRN: top-1 1.0) is not here.
"""

from __future__ import annotations

from typing import Any

from quantkit.errors import SourceModelError

_HINT = "serve this checkpoint with an engine that follows transformers (vLLM), or choose another method"


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def refuse(config: dict[str, Any]) -> None:
    """Raise SourceModelError (exit 2, one line) for a configuration llama.cpp would compute differently."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else "?"
    if arch == "Qwen3MoeForCausalLM" and config.get("norm_topk_prob") is False:
        raise SourceModelError(f"{arch}: norm_topk_prob is false, but llama.cpp's qwen3moe architecture always "
                               "renormalises the chosen experts' weights; the GGUF would route differently from "
                               "transformers", hint=_HINT)
    if arch == "Gemma3ForCausalLM" and (types := config.get("layer_types")):
        fixed = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(len(types))]
        if list(types) != fixed:
            raise SourceModelError(f"{arch}: layer_types {types} are not llama.cpp's fixed Gemma 3 pattern (every "
                                   "sixth layer full attention); the GGUF would attend differently", hint=_HINT)
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        if config.get("attention_bias"):
            raise SourceModelError(f"{arch}: attention_bias is true, but llama.cpp's MLA attention has no biases",
                                   hint=_HINT)
        if config.get("rope_interleave") is False:
            raise SourceModelError(f"{arch}: rope_interleave is false (rotate-half rope), but llama.cpp rotates "
                                   "the interleaved pairs of DeepSeek's own layout; the GGUF would compute "
                                   "different logits", hint=_HINT)
        if arch == "DeepseekV3ForCausalLM" and config.get("scoring_func") is None:
            raise SourceModelError(f"{arch}: config.json has no scoring_func, so llama.cpp's converter leaves the "
                                   "expert gating to llama.cpp's default (softmax), while DeepSeek-V3 gates with "
                                   "sigmoid; the GGUF would route differently from transformers",
                                   hint='add "scoring_func": "sigmoid" to config.json, as DeepSeek publishes it')
        rope = _rope(config)
        if rope.get("rope_type") == "yarn" and rope.get("mscale") != rope.get("mscale_all_dim"):
            raise SourceModelError(f"{arch}: llama.cpp's YaRN for this architecture cannot reproduce rope parameters "
                                   f"mscale {rope.get('mscale')} with mscale_all_dim {rope.get('mscale_all_dim')} "
                                   "(it scales attention by mscale_all_dim alone); the GGUF would compute different "
                                   "attention", hint=_HINT)
