"""The architecture table (quantkit/architectures.py): one row per Hugging Face architecture, each named as
transformers names it, no family twice, and every consumer reading its rows (the matrix of tested families is
tests/test_architectures.py)."""

from __future__ import annotations

import pytest
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from quantkit import architectures
from quantkit.architectures import TABLE
from quantkit.errors import SourceModelError
from quantkit.producers import moe
from quantkit.producers.gguf import guards

pytestmark = pytest.mark.unit


def test_each_row_is_the_architecture_transformers_builds_for_its_model_type() -> None:
    """A causal LM's row is named as AutoModelForCausalLM builds it, a vision-language model's as
    AutoModelForImageTextToText does (the class quantkit loads it with)."""
    for row in TABLE:
        names = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if row.vision else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        assert names.get(row.model_type) == row.name, row.name


def test_no_architecture_model_type_or_moe_family_is_listed_twice() -> None:
    for key in (lambda r: r.name, lambda r: r.model_type, lambda r: r.moe and r.moe.name):
        values = [key(r) for r in TABLE if key(r)]
        assert len(values) == len(set(values))


def test_the_moe_names_the_consumers_read_come_from_the_table() -> None:
    assert architectures.EXPERT_COUNT_KEYS == ("num_experts", "num_local_experts", "n_routed_experts")
    assert architectures.TRT_DECODERS == {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    assert moe.family(mixtral) is architectures.BY_NAME["MixtralForCausalLM"].moe
    assert moe.router_patterns({"model_type": "qwen2_moe"}) == [r"re:.*\.mlp\.gate$",
                                                                r"re:.*\.mlp\.shared_expert_gate$"]
    assert moe.family({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) is None


@pytest.mark.parametrize(("config", "message"), [
    ({"architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": False}, "norm_topk_prob is false"),
    ({"architectures": ["Gemma3ForCausalLM"], "layer_types": ["full_attention", "sliding_attention"]},
     "not llama.cpp's fixed Gemma 3 pattern"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": True}, "attention_bias is true"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "sigmoid",
      "rope_scaling": {"rope_type": "yarn", "mscale": 1.0, "mscale_all_dim": 0.707}}, "mscale 1.0 with mscale_all"),
])
def test_the_llama_cpp_quirks_of_a_row_refuse_and_others_pass(config: dict, message: str) -> None:
    with pytest.raises(SourceModelError, match=message) as e:
        guards.refuse(config)
    assert e.value.message.startswith(config["architectures"][0] + ": ") and e.value.hint


def test_a_config_without_a_quirk_passes() -> None:
    guards.refuse({"architectures": ["Gemma3ForCausalLM"],
                   "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    guards.refuse({"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "sigmoid"})
    guards.refuse({"architectures": ["DeepseekV2ForCausalLM"]})  # scoring_func is DeepSeek-V3's alone
    guards.refuse({"architectures": ["Qwen2MoeForCausalLM"], "norm_topk_prob": False})  # Qwen3-MoE's alone
    guards.refuse({})
