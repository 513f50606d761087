"""Model shapes the benchmarks build with random weights, shared by every bench script and scripts/gpu_cases.py.

A shape carries its architecture (the transformers class and ``model_type``) and the config fields that make it
that shape; :meth:`Shape.config` adds the family's fixed fields (activation, norms, rope), so a script builds the
right model class from the name alone. Token ids are left to each script: they belong to the tokenizer it ships.

Llama shapes follow the Llama 3.x configs; the 32B dense shapes follow Qwen2.5-32B's published config.json (64
layers of hidden 5120 and intermediate 27648, 40 query heads and 8 KV heads of 128 with biases on q, k and v,
vocabulary 152,064, rope theta 1e6, 32,768 positions); the MoE shapes follow Qwen3-30B-A3B's (48 layers of hidden
2048, 128 experts of intermediate 768, top-8 with renormalised weights, 32 query heads and 4 KV heads of 128,
vocabulary 151,936, rope theta 1e6 without scaling, 40,960 positions), all 48 layers or fewer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


def llama3_rope(factor: float) -> dict:
    """Llama 3.x rope scaling: factor 8 for Llama-3.1, 32 for Llama-3.2."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# What every checkpoint of a family has in config.json besides its shape.
FAMILY = {
    "llama": {"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "attention_bias": False, "mlp_bias": False},
    "qwen2": {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0},
    "qwen3_moe": {"hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000.0, "attention_bias": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
                  "router_aux_loss_coef": 0.001, "output_router_logits": False, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: the transformers class that builds it and the config fields that size it."""

    architecture: str  # the transformers model class, e.g. "LlamaForCausalLM"
    model_type: str  # its config's model_type, a key of FAMILY
    fields: dict[str, Any] = field(default_factory=dict)
    mirrors: str = ""  # the published model it copies the width of
    projected: bool = False  # only projected from measured shapes (bench/project.py), never built

    @property
    def moe(self) -> bool:
        return "num_experts" in self.fields

    def config(self) -> dict[str, Any]:
        """config.json fields (without token ids): architecture, the family's fixed fields, the shape's. A deep copy:
        transformers 5 writes into the nested dicts it is given (``rope_theta`` into ``rope_scaling``), and a caller
        that hands these to it must not change the table, nor what the next caller gets to compare a stamp with."""
        return copy.deepcopy({"architectures": [self.architecture], "model_type": self.model_type,
                              **FAMILY[self.model_type], **self.fields})


def _llama(mirrors: str = "", projected: bool = False, **fields: Any) -> Shape:
    return Shape("LlamaForCausalLM", "llama", fields, mirrors, projected)


def _qwen2(mirrors: str = "", **fields: Any) -> Shape:
    return Shape("Qwen2ForCausalLM", "qwen2", fields, mirrors)


def _qwen3_moe(mirrors: str = "", **fields: Any) -> Shape:
    return Shape("Qwen3MoeForCausalLM", "qwen3_moe", fields, mirrors)


_LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                  vocab_size=128256, tie_word_embeddings=False, rope_scaling=llama3_rope(8.0))
_QWEN25_32B = dict(hidden_size=5120, intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8,
                   vocab_size=152064, tie_word_embeddings=False)
_QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      vocab_size=151936)

SHAPES: dict[str, Shape] = {
    "tiny": _llama("the reference model", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False,
                   rope_scaling=llama3_rope(8.0)),
    "small": _llama(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, rope_scaling=llama3_rope(8.0)),
    "1b": _llama("Llama-3.2-1B", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                 rope_scaling=llama3_rope(32.0)),
    "3b": _llama("Llama-3.2-3B", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                 num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                 rope_scaling=llama3_rope(32.0)),
    "8b": _llama("Llama-3.1-8B", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                 rope_scaling=llama3_rope(8.0)),
    "70b": _llama("Llama-3.1-70B", **_LLAMA_70B, num_hidden_layers=80),
    # Llama-3.1-70B's width with 4 and 8 of its 80 layers: what grows per layer and what does not, measured on a
    # device whose 64 GiB disk cannot hold the 141 GB checkpoint (bench/project.py projects 70B and 405B from them).
    "70b-4l": _llama("Llama-3.1-70B, 4 of 80 layers", **_LLAMA_70B, num_hidden_layers=4),
    "70b-8l": _llama("Llama-3.1-70B, 8 of 80 layers", **_LLAMA_70B, num_hidden_layers=8),
    # Projected only (bench/project.py), never built: 406B parameters.
    "405b": _llama("Llama-3.1-405B", projected=True, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                   num_attention_heads=128, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                   rope_scaling=llama3_rope(8.0)),
    # Qwen2.5-32B's shape (32.8B parameters, 65.5 GB bf16): more than the 64 GiB disk of a one-H200 machine holds
    # beside its output, so bench/wide.py plans it there and refuses it, and measures the width at 8 layers.
    "32b": _qwen2("Qwen2.5-32B", **_QWEN25_32B, num_hidden_layers=64, max_window_layers=64),
    "32b-8l": _qwen2("Qwen2.5-32B, 8 of 64 layers", **_QWEN25_32B, num_hidden_layers=8, max_window_layers=8),
    # Qwen3-30B-A3B itself: 30.5B parameters (61.1 GB bf16), 3.3B active per token.
    "qwen3-30b-a3b": _qwen3_moe("Qwen3-30B-A3B", **_QWEN3_30B_A3B, num_hidden_layers=48),
    # Qwen3-30B-A3B's width with 12 of its 48 layers: 8.1B parameters (16.2 GB bf16), 0.99B active per token.
    "qwen3-30b-a3b-12l": _qwen3_moe("Qwen3-30B-A3B, 12 of 48 layers", **_QWEN3_30B_A3B, num_hidden_layers=12),
    # Its width with 2 layers (1.9B parameters, 3.8 GB bf16): the load, linearization and save path of the real
    # width on a CPU machine.
    "qwen3-30b-a3b-2l": _qwen3_moe("Qwen3-30B-A3B, 2 of 48 layers", **_QWEN3_30B_A3B, num_hidden_layers=2),
    # The same structure for CPU checks: top-2 of 8 experts, attention wider than the residual stream as in the
    # real one, every quantized row a multiple of 128 (GPTQ groups, vLLM's Marlin MoE tiles).
    "moe-tiny": _qwen3_moe(hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_experts=8,
                           num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           num_hidden_layers=2, vocab_size=8192),
}

BUILDABLE = {name: s for name, s in SHAPES.items() if not s.projected}
LLAMA = {name: s for name, s in BUILDABLE.items() if s.model_type == "llama"}
