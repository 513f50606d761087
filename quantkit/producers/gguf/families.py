"""Which Hugging Face architectures convert to GGUF, and how each differs from the plain Llama layout.

One declarative row per family: the GGUF architecture llama.cpp runs it as, and the handful of ways its
checkpoint must be reshaped for llama.cpp's graph (the rest is common to all of them and lives in
:mod:`.tensors` and :mod:`.metadata`). Each difference is a field, so adding a family is adding a row, and a
reviewer can see at a glance what is special about, say, Gemma.

Tested with gguf 0.19.0 and llama-cpp-python 0.3.36 (its bundled llama.cpp), transformers 5.17.0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import SourceModelError


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts checkpoint stores its experts: one 2-D tensor per expert and projection.

    llama.cpp wants one 3-D tensor per projection (experts stacked on the outer axis). ``pattern`` matches a
    per-expert tensor name with groups ``prefix``, ``expert`` and ``proj``; the stacked tensor's Hugging Face
    name is ``{prefix}.{proj}.weight``, which :class:`gguf.TensorNameMap` knows.
    """

    pattern: str
    count_key: str
    used_key: str

    def match(self, name: str) -> re.Match[str] | None:
        return re.fullmatch(self.pattern, name)


@dataclass(frozen=True)
class Family:
    """One supported architecture family and its conversion quirks."""

    key: str
    label: str
    architectures: tuple[str, ...]
    gguf_arch: str  # member name of gguf.MODEL_ARCH
    # Hugging Face stores q/k rows in rotate-half order; llama.cpp's "normal" rope (the llama arch) wants
    # the pairs interleaved, so those rows are permuted. NeoX-rope archs (qwen, gemma, phi3) keep HF order.
    rope_permute: bool = False
    # Gemma's RMSNorm computes x * (1 + w); llama.cpp computes x * w, so w + 1 is stored.
    norm_plus_one: bool = False
    # Gemma 2 has no output tensor in llama.cpp at all: the embeddings are always tied.
    always_tied: bool = False
    experts: Experts | None = None
    sliding_window: bool = False  # write the window and which layers use it
    softcapping: bool = False  # attention and final logit soft-capping (Gemma 2)
    swa_rope_base: bool = False  # sliding layers have their own rope base (Gemma 3)
    # llama.cpp hard-codes Gemma's attention scale to 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 46-layer
    # 27B), ignoring query_pre_attn_scalar; a checkpoint that differs would convert silently wrong.
    fixed_attention_scale: bool = False
    # The rope scaling types (transformers' rope_type) llama.cpp reproduces for this family.
    rope_types: tuple[str, ...] = ("default",)


MIXTRAL_EXPERTS = Experts(
    pattern=r"(?P<prefix>model\.layers\.\d+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight",
    count_key="num_local_experts",
    used_key="num_experts_per_tok",
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 2/3", ("LlamaForCausalLM",), "LLAMA", rope_permute=True,
           rope_types=("default", "linear", "llama3")),
    Family("mistral", "Mistral", ("MistralForCausalLM",), "LLAMA", rope_permute=True,
           rope_types=("default", "linear")),
    Family("mixtral", "Mixtral (MoE)", ("MixtralForCausalLM",), "LLAMA", rope_permute=True,
           experts=MIXTRAL_EXPERTS),
    Family("qwen2", "Qwen2/2.5", ("Qwen2ForCausalLM",), "QWEN2", rope_types=("default", "linear")),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), "QWEN3", rope_types=("default", "linear")),
    Family("gemma2", "Gemma 2", ("Gemma2ForCausalLM",), "GEMMA2", norm_plus_one=True, always_tied=True,
           sliding_window=True, softcapping=True, fixed_attention_scale=True),
    Family("gemma3", "Gemma 3 (text)", ("Gemma3ForCausalLM",), "GEMMA3", norm_plus_one=True,
           sliding_window=True, swa_rope_base=True, fixed_attention_scale=True,
           rope_types=("default", "linear")),
    Family("phi3", "Phi-3", ("Phi3ForCausalLM",), "PHI3"),
)


def supported() -> list[str]:
    """Every Hugging Face architecture name that converts, for error messages and docs."""
    return [a for f in FAMILIES for a in f.architectures]


def resolve(config: dict) -> Family:
    """The family of a checkpoint from its ``config.json``; refuses anything not in the table."""
    archs = config.get("architectures") or []
    for arch in archs:
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam
    got = ", ".join(archs) if archs else f"no 'architectures' (model_type {config.get('model_type', '?')!r})"
    raise SourceModelError(
        f"GGUF conversion does not support {got}; supported architectures: {', '.join(supported())}",
        hint="convert it with llama.cpp's own convert_hf_to_gguf.py, or choose another quantization method")
