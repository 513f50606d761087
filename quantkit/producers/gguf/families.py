"""Which Hugging Face architectures convert to GGUF, and how each differs from the plain Llama layout.

One declarative row per family: the GGUF architecture llama.cpp runs it as, and the handful of ways its
checkpoint must be reshaped for llama.cpp's graph (the rest is common to all of them and lives in
:mod:`.tensors` and :mod:`.metadata`). Each difference is a field, so adding a family is adding a row, and a
reviewer can see at a glance what is special about, say, Gemma. Mixture-of-experts families also say how their
router chooses and weighs experts (:class:`Experts`), which llama.cpp must reproduce exactly: a different rule
converts into a model that loads and routes tokens elsewhere, so a checkpoint whose rule llama.cpp's graph for
that architecture does not compute is refused in :mod:`.metadata`.

Tested with gguf 0.19.0 and llama-cpp-python 0.3.36 (its bundled llama.cpp), transformers 5.17.0.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import SourceModelError


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts family routes each token, and which config keys say so.

    Where the expert weights are stored (one 2-D tensor per expert, as published on the hub, or the fused 3-D
    ``gate_up_proj``/``down_proj`` tensors transformers 5 keeps in memory) does not depend on the family and is
    read in :mod:`.tensors`. What differs is the routing, and llama.cpp must compute exactly the same one:

    * ``gating``: softmax or sigmoid over the router logits (llama.cpp's ``expert_gating_func``);
    * ``norm_key``: the config key that says whether the chosen experts' weights are renormalised to sum to 1
      (None: the family always renormalises); ``norm_in_file``: llama.cpp reads that choice from the file
      (``expert_weights_norm``) instead of hard-coding renormalisation, which a checkpoint must then match;
    * ``scale_key``: a factor the chosen weights are multiplied by (``expert_weights_scale``);
    * ``shared_key``: experts every token goes through besides the routed ones;
    * ``groups``: config keys of the group count and the groups kept (experts are chosen in the best groups);
    * ``dense_lead_key``: the number of leading layers that have a dense MLP instead of experts;
    * ``ffn_key``: one expert's intermediate size, where it is not ``intermediate_size``.
    """

    count_key: str
    used_key: str
    ffn_key: str | None = None
    gating: str = "softmax"
    norm_key: str | None = None
    norm_in_file: bool = False
    scale_key: str | None = None
    shared_key: str | None = None
    groups: tuple[str, str] | None = None
    dense_lead_key: str | None = None


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
    # Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections; kv_b_proj is split into the
    # per-head k_b (transposed) and v_b that llama.cpp's absorbed attention multiplies with.
    mla: bool = False
    # Hugging Face tensor names llama.cpp's name table spells differently: (regex, replacement) pairs
    # (DeepSeek-V3's per-expert score correction, added to the router's scores for choosing only).
    renames: tuple[tuple[str, str], ...] = ()
    # Layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction module) are left out: transformers
    # ignores them when it computes logits, and llama.cpp's own converter leaves them out of this architecture.
    extra_layers_ignored: bool = False
    sliding_window: bool = False  # write the window and which layers use it
    softcapping: bool = False  # attention and final logit soft-capping (Gemma 2)
    swa_rope_base: bool = False  # sliding layers have their own rope base (Gemma 3)
    # llama.cpp hard-codes Gemma's attention scale to 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 46-layer
    # 27B), ignoring query_pre_attn_scalar; a checkpoint that differs would convert silently wrong.
    fixed_attention_scale: bool = False
    # The rope scaling types (transformers' rope_type) llama.cpp reproduces for this family.
    rope_types: tuple[str, ...] = ("default",)


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 2/3", ("LlamaForCausalLM",), "LLAMA", rope_permute=True,
           rope_types=("default", "linear", "llama3")),
    Family("mistral", "Mistral", ("MistralForCausalLM",), "LLAMA", rope_permute=True,
           rope_types=("default", "linear")),
    Family("mixtral", "Mixtral (MoE)", ("MixtralForCausalLM",), "LLAMA", rope_permute=True,
           experts=Experts("num_local_experts", "num_experts_per_tok")),
    Family("qwen2", "Qwen2/2.5", ("Qwen2ForCausalLM",), "QWEN2", rope_types=("default", "linear")),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), "QWEN3", rope_types=("default", "linear")),
    Family("qwen3moe", "Qwen3-MoE", ("Qwen3MoeForCausalLM",), "QWEN3MOE", rope_types=("default", "linear"),
           experts=Experts("num_experts", "num_experts_per_tok", ffn_key="moe_intermediate_size",
                           norm_key="norm_topk_prob")),
    Family("deepseek3", "DeepSeek-V3", ("DeepseekV3ForCausalLM",), "DEEPSEEK2", mla=True,
           rope_types=("default", "yarn"),
           experts=Experts("n_routed_experts", "num_experts_per_tok", ffn_key="moe_intermediate_size",
                           gating="sigmoid", norm_key="norm_topk_prob", norm_in_file=True,
                           scale_key="routed_scaling_factor", shared_key="n_shared_experts",
                           groups=("n_group", "topk_group"), dense_lead_key="first_k_dense_replace"),
           renames=((r"\.e_score_correction_bias$", ".e_score_correction.bias"),), extra_layers_ignored=True),
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
