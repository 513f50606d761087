"""Train the mixture-of-experts reference model ``quantkit-tiny-moe`` (Qwen3-MoE architecture, ~5.6 M parameters).

Shape: hidden 256, 2 layers, 4 heads of 64, 2 KV heads (q/k norms, as Qwen3), 8 experts of intermediate 256 in
every layer, 2 chosen per token (softmax router, the chosen weights renormalised, as Qwen3-MoE does), vocab 8192
(the reference tokenizer), embeddings tied so the whole model stays under 12 MB in bf16. Every quantized row
(256) divides by 128 for group quantization and by 256 for GGUF K-quants; the 128-row K/V projections are the
same as the dense model's.

The data, optimiser, schedule and stopping rule are the dense model's (``training.py``), on the same training
split. The router is trained with transformers' load-balancing loss (``router_aux_loss_coef``, Switch
Transformer style) at a modest weight: it keeps every expert in use without making them equally used, so the
routing stays skewed the way trained routers are, which is what quantization of experts has to cope with.
Deterministic kernels are switched on (expert outputs are summed with ``index_add_``, which is atomic on the
GPU otherwise), and the experts run transformers' plain ("eager") implementation, the same code on a GPU and a
CPU.

Writes, into ``--out``: the best checkpoint in bf16 (one ``model.safetensors``), the tokenizer files,
``metrics.json`` (the run, held-out perplexity and each expert's share of the held-out tokens per layer) and the
model card ``README.md``. ``moe_stats.py`` recomputes the held-out figures from a saved model on a CPU.

Usage (on a GPU, from the repository root, after prepare_corpus.py)::

    python models/scripts/train_moe.py --out /tmp/quantkit-tiny-moe
"""

from __future__ import annotations

import json
import shutil

import torch
from tokenizers import Tokenizer
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moe_stats
import training

EXPERTS, TOP_K, EXPERT_FFN, LAYERS = 8, 2, 256, 2
AUX_LOSS_COEF = 0.01
EXPERTS_IMPL = "eager"  # transformers' plain per-expert loop: the same code on a GPU and a CPU
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build(tok: Tokenizer, seq_len: int) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=EXPERT_FFN, intermediate_size=3 * EXPERT_FFN, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=AUX_LOSS_COEF,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        hidden_act="silu", initializer_range=0.02, experts_implementation=EXPERTS_IMPL, **training.special_ids(tok),
    )
    return Qwen3MoeForCausalLM(config)


def main() -> None:
    args = training.arg_parser(__doc__, max_steps=2000, max_minutes=4.0).parse_args()

    training.deterministic()
    torch.manual_seed(args.seed)
    device = args.device
    tok, train, held = training.data(args)

    model = build(tok, args.seq_len).to(device)
    run = training.fit(model, args, train, held)
    metrics = training.run_metrics(model, args, train, held, run)
    metrics["moe"] = {"experts": EXPERTS, "top_k": TOP_K, "expert_ffn": EXPERT_FFN, "layers": LAYERS,
                      "router_aux_loss_coef": AUX_LOSS_COEF, "experts_implementation": EXPERTS_IMPL}

    model.load_state_dict({k: v.to(device) for k, v in run.best_state.items()})
    metrics["heldout"] = moe_stats.measure(model, held, device)
    model.config.output_router_logits = False  # the load-balancing loss is for training only
    model.generation_config.eos_token_id = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|im_end|>")]
    training.save_best(model, run, args.out, max_shard_size="64MB")
    for f in TOKENIZER_FILES:
        shutil.copy(args.tokenizer / f, args.out / f)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (args.out / "README.md").write_text(moe_stats.card(metrics))
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}), flush=True)


if __name__ == "__main__":
    main()
