"""THE table of model architectures: one row per Hugging Face architecture, with what each part of quantkit needs.

A row is keyed by the architecture ``config.json`` names first (``architectures[0]``, the transformers class, also
vLLM's and llama.cpp's converter's registry name) and says, as data:

* ``moe``: where a mixture-of-experts family keeps its routers and experts under a decoder layer and how its
  checkpoints name them (:class:`MoeFamily`): the default ignore list (:mod:`quantkit.ignore`), llm-compressor's
  MoE work and the coverage check (:mod:`quantkit.producers.moe`), and the evaluation's dense copy read it;
* ``trt_decoder``: ModelOpt's ``decoder_type`` for the TensorRT-LLM export, for the architectures it is tested with
  (:mod:`quantkit.producers.trt`);
* ``llama_cpp_refuses``: configurations llama.cpp's converter takes but converts wrong, each measured
  (:mod:`quantkit.producers.gguf.guards` refuses them before any work);
* ``vision``: a vision-language model's parts kept as they are (:class:`VisionLanguage`): the vision tower and the
  projector stay in the source's precision while the language model is quantized (the default ignore list, the
  check that they left the quantizer byte for byte unchanged, the manifest's list of them).

An architecture that needs none of these (Llama-like dense decoders: most of ``tests/data/architectures.yaml``, the
matrix they are tested on) has no row. Standard library only, the bottom floor: it imports nothing of quantkit.

MoE module names are transformers 5.17's in-memory names (the router of every family is ``mlp.gate``, also for
Mixtral, whose checkpoints say ``block_sparse_moe``). A family is found by ``model_type`` (:func:`moe_family`), as
quantkit always has: a config written without ``architectures`` still names it. Tested with transformers 5.17.0,
llmcompressor 0.14.0.1 (the MoE rows) and llama.cpp b11312 (its quirks).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Config = dict[str, Any]


# ----------------------------------------------------------------------------------------------------------------
# Mixture-of-experts routing


def _qwen_moe_layer(cfg: Config, i: int) -> bool:
    """Qwen2/3-MoE: every ``decoder_sparse_step``-th layer, except ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _deepseek_moe_layer(cfg: Config, i: int) -> bool:
    """DeepSeek-V3: dense MLPs in the first ``first_k_dense_replace`` layers, experts after."""
    return i >= int(cfg.get("first_k_dense_replace") or 0)


@dataclass(frozen=True)
class MoeFamily:
    """One MoE family: where its routers and experts live under a decoder layer, and how its checkpoints name them.

    ``checkpoint_block`` and ``checkpoint_projections`` are the checkpoint's spelling of the MoE block and of each
    expert projection where it differs from the in-memory one (empty when they are the same).
    """

    name: str  # recorded in the manifest (quantization.moe.family)
    experts_keys: tuple[str, ...]  # config keys that may hold the number of routed experts (hub, then transformers 5)
    moe_layer: Callable[[Config, int], bool] = lambda cfg, i: True
    router: str = "mlp.gate"
    shared_gate: str | None = None
    experts: str = "mlp.experts"
    projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    checkpoint_block: str | None = None
    checkpoint_projections: dict[str, str] = field(default_factory=dict)

    def num_experts(self, cfg: Config) -> int:
        return int(next(cfg[k] for k in self.experts_keys if cfg.get(k) is not None))

    def top_k(self, cfg: Config) -> int:
        return int(cfg["num_experts_per_tok"])

    def layers(self, cfg: Config) -> list[int]:
        """The decoder layers that hold experts."""
        return [i for i in range(int(cfg["num_hidden_layers"])) if self.moe_layer(cfg, i)]


# ----------------------------------------------------------------------------------------------------------------
# What llama.cpp's converter (b11312) converts wrong: the file then computes other logits than transformers (F32 GGUF
# against transformers in float32, 512 held-out tokens, random 2-layer checkpoints of tests/moe_models.py;
# tests/test_gguf_moe.py repeats every case). What upstream gets right where quantkit's own converter refused
# (Qwen3-MoE with YaRN: top-1 1.0) is not here.


@dataclass(frozen=True)
class LlamaCppQuirk:
    """A configuration llama.cpp converts wrong: when ``wrong(config)`` holds, the reason (after the architecture's
    name) and a hint, or None for the guards' own (serve it with an engine that follows transformers)."""

    wrong: Callable[[Config], bool]
    reason: Callable[[Config], str]
    hint: str | None = None


def _rope(cfg: Config) -> Config:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _gemma3_pattern(n: int) -> list[str]:
    return ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(n)]


# llama.cpp's qwen3moe graph always renormalises the chosen experts' weights (top-1 0.945, largest logit difference
# 2.75 with norm_topk_prob false).
_NORM_TOPK = LlamaCppQuirk(
    lambda c: c.get("norm_topk_prob") is False,
    lambda c: "norm_topk_prob is false, but llama.cpp's qwen3moe architecture always renormalises the chosen experts' "
              "weights; the GGUF would route differently from transformers")
# Gemma 3 whose layer_types are not llama.cpp's fixed pattern (every sixth layer full attention, the rest sliding;
# the converter writes no pattern): a 2-layer sliding/full checkpoint differs by 2.44 in its logits
# (tests/test_gguf.py, before its Gemma 3 case took the real pattern).
_GEMMA3_LAYERS = LlamaCppQuirk(
    lambda c: bool(c.get("layer_types")) and list(c["layer_types"]) != _gemma3_pattern(len(c["layer_types"])),
    lambda c: f"layer_types {c['layer_types']} are not llama.cpp's fixed Gemma 3 pattern (every sixth layer full "
              "attention); the GGUF would attend differently")
# llama.cpp's MLA attention has no biases: the file does not load.
_MLA_BIAS = LlamaCppQuirk(lambda c: bool(c.get("attention_bias")),
                          lambda c: "attention_bias is true, but llama.cpp's MLA attention has no biases")
# llama.cpp rotates the interleaved pairs of DeepSeek's own layout (top-1 0.002 with rope_interleave false).
_ROPE_HALF = LlamaCppQuirk(
    lambda c: c.get("rope_interleave") is False,
    lambda c: "rope_interleave is false (rotate-half rope), but llama.cpp rotates the interleaved pairs of DeepSeek's "
              "own layout; the GGUF would compute different logits")
# DeepSeek's own config.json says scoring_func sigmoid; transformers' config class does not write it. Without it the
# converter writes no expert_gating_func and llama.cpp gates with softmax, while transformers' DeepSeek-V3 always
# uses sigmoid (top-1 0.43).
_NO_SCORING = LlamaCppQuirk(
    lambda c: c.get("scoring_func") is None,
    lambda c: "config.json has no scoring_func, so llama.cpp's converter leaves the expert gating to llama.cpp's "
              "default (softmax), while DeepSeek-V3 gates with sigmoid; the GGUF would route differently from "
              "transformers",
    hint='add "scoring_func": "sigmoid" to config.json, as DeepSeek publishes it')
# llama.cpp's deepseek2 graph scales attention by mscale_all_dim alone (top-1 0.40 with another mscale).
_YARN_MSCALE = LlamaCppQuirk(
    lambda c: _rope(c).get("rope_type") == "yarn" and _rope(c).get("mscale") != _rope(c).get("mscale_all_dim"),
    lambda c: f"llama.cpp's YaRN for this architecture cannot reproduce rope parameters mscale "
              f"{_rope(c).get('mscale')} with mscale_all_dim {_rope(c).get('mscale_all_dim')} (it scales attention by "
              "mscale_all_dim alone); the GGUF would compute different attention")


# ----------------------------------------------------------------------------------------------------------------
# Vision-language models


@dataclass(frozen=True)
class VisionLanguage:
    """A vision-language family: which top-level parts of the model are its vision side, kept unquantized.

    ``keep`` are module names under the model (transformers 5.17's in-memory ``model.<part>``, also the checkpoint's
    ``<part>`` and vLLM's): every tensor under them is left as the source has it. Quantizing a vision tower saves
    little (it is a few percent of the weights) and its activations are nothing like the text calibration
    samples; llm-compressor's examples, vLLM's and llama.cpp's mmproj files all keep it in 16 bits. The language
    model is ``model.language_model`` in every family transformers 5 has.
    """

    family: str  # recorded in the manifest (quantization.vision.family)
    keep: tuple[str, ...]  # the vision tower and projector parts, as named under the model

    def ignore_patterns(self) -> list[str]:
        """The parts as llm-compressor ignore patterns that match the in-memory, checkpoint and vLLM names."""
        return [f"re:(.*\\.)?{re.escape(part)}\\..*" for part in self.keep]

    def kept(self, tensor: str) -> bool:
        """Whether a tensor name (in-memory or checkpoint spelling) belongs to a part kept as it is."""
        return any(re.match(f"(.*\\.)?{re.escape(part)}\\.", tensor) for part in self.keep)


_TOWER = ("vision_tower", "multi_modal_projector")


# ----------------------------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture and what quantkit must know about it beyond a Llama-like dense decoder."""

    name: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type
    moe: MoeFamily | None = None
    trt_decoder: str | None = None  # ModelOpt's decoder_type for the TensorRT-LLM export (tested ones only)
    llama_cpp_refuses: tuple[LlamaCppQuirk, ...] = ()  # checked in this order
    vision: VisionLanguage | None = None


_QWEN_EXPERTS = ("num_experts", "num_local_experts")

TABLE: tuple[Architecture, ...] = (
    # ModelOpt maps Mistral to the same decoder as Llama; LlamaForCausalLM is the one tested end to end.
    Architecture("LlamaForCausalLM", "llama", trt_decoder="llama"),
    Architecture("MistralForCausalLM", "mistral", trt_decoder="llama"),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", MoeFamily("qwen3-moe", _QWEN_EXPERTS, _qwen_moe_layer),
                 llama_cpp_refuses=(_NORM_TOPK,)),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", MoeFamily("qwen2-moe", _QWEN_EXPERTS, _qwen_moe_layer,
                                                               shared_gate="mlp.shared_expert_gate")),
    Architecture("MixtralForCausalLM", "mixtral", MoeFamily(
        "mixtral", ("num_local_experts",), checkpoint_block="block_sparse_moe",
        checkpoint_projections={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"})),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3",
                 MoeFamily("deepseek-v3", ("n_routed_experts", "num_local_experts"), _deepseek_moe_layer),
                 llama_cpp_refuses=(_MLA_BIAS, _ROPE_HALF, _NO_SCORING, _YARN_MSCALE)),
    Architecture("DeepseekV2ForCausalLM", "deepseek_v2", llama_cpp_refuses=(_MLA_BIAS, _ROPE_HALF, _YARN_MSCALE)),
    Architecture("Gemma3ForCausalLM", "gemma3_text", llama_cpp_refuses=(_GEMMA3_LAYERS,)),
    # Vision-language models: the families transformers 5.17 and vLLM 0.26 both have (tests/vlm_models.py makes the
    # first three; the others share their part names).
    Architecture("LlavaForConditionalGeneration", "llava", vision=VisionLanguage("llava", _TOWER)),
    Architecture("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", vision=VisionLanguage("qwen2.5-vl", ("visual",))),
    Architecture("Gemma3ForConditionalGeneration", "gemma3", vision=VisionLanguage("gemma3", _TOWER),
                 llama_cpp_refuses=(_GEMMA3_LAYERS,)),
    Architecture("Qwen2VLForConditionalGeneration", "qwen2_vl", vision=VisionLanguage("qwen2-vl", ("visual",))),
    Architecture("Qwen3VLForConditionalGeneration", "qwen3_vl", vision=VisionLanguage("qwen3-vl", ("visual",))),
    Architecture("Mistral3ForConditionalGeneration", "mistral3", vision=VisionLanguage("mistral3", _TOWER)),
    Architecture("InternVLForConditionalGeneration", "internvl", vision=VisionLanguage("internvl", _TOWER)),
)
BY_NAME = {a.name: a for a in TABLE}
# ModelOpt's decoder per tested architecture, in the table's order (the export refuses the rest, naming these).
TRT_DECODERS = {a.name: a.trt_decoder for a in TABLE if a.trt_decoder}
# Every config key that may hold a model's number of routed experts: whether a checkpoint is a mixture of experts,
# also one of a family without a row (vLLM's kernel choice reads it).
EXPERT_COUNT_KEYS = tuple(dict.fromkeys(k for a in TABLE if a.moe for k in a.moe.experts_keys))


def get(config: Config) -> Architecture | None:
    """The row of a model's architecture (its ``config.json``), or None when quantkit needs nothing special."""
    archs = config.get("architectures") or []
    return BY_NAME.get(archs[0]) if archs else None


def vision_language(config: Config) -> VisionLanguage | None:
    """The vision side of a vision-language model (its ``config.json``), or None for a text-only model."""
    row = get(config)
    return row.vision if row else None


def text_config(config: Config) -> Config:
    """The language model's config: a vision-language model's ``text_config`` (widths, layers, vocabulary), else
    the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and nested else config


def moe_family(config: Config) -> MoeFamily | None:
    """The MoE family of a model (its ``config.json``), or None for a dense model or an MoE quantkit does not know."""
    model_type = config.get("model_type")
    return next((a.moe for a in TABLE if a.moe and a.model_type == model_type), None)


def _pattern(suffix: str) -> str:
    return "re:.*\\." + re.escape(suffix) + "$"


def router_patterns(config: Config) -> list[str]:
    """The ignore patterns (llm-compressor's ``re:`` syntax) of the family's routers and shared-expert gates.

    Every pattern matches a module of every model of the family (the router of each MoE layer), so a default
    ignore list can include them without tripping a "pattern matches nothing" check. Empty for a dense model.
    """
    fam = moe_family(config)
    if fam is None:
        return []
    return [_pattern(fam.router)] + ([_pattern(fam.shared_gate)] if fam.shared_gate else [])
