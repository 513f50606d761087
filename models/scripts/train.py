"""Train the reference model ``quantkit-tiny`` (Llama architecture, ~10.5 M parameters) on the training split.

Shape: hidden 256, 8 layers, 4 heads of 64, 2 KV heads, intermediate 768, vocab 8192, untied embeddings.
Every quantized dimension (256, 128, 768) divides by 128 for group quantization and by 256 where GGUF K-quants
need it (256, 768; 128-wide K/V rows fall back the way llama.cpp does).

Training stops when the held-out loss has not improved for ``--patience`` evaluations, and the best checkpoint
(by held-out loss) is saved in bf16 with ``metrics.json`` describing the run. Deterministic for a given seed,
GPU and software versions. The data, loop and stopping rule are shared with ``train_moe.py`` (``training.py``).

Usage (on a GPU, from the repository root, after prepare_corpus.py and train_tokenizer.py)::

    python models/scripts/train.py --train .train/train.jsonl.gz --heldout calibration/heldout.jsonl.gz \
        --tokenizer models/quantkit-tiny --out /tmp/quantkit-tiny
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import training


def main() -> None:
    args = training.arg_parser(__doc__).parse_args()

    torch.manual_seed(args.seed)
    device = args.device
    tok, train, held = training.data(args)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
        initializer_range=0.02, **training.special_ids(tok),
    )
    model = LlamaForCausalLM(config).to(device)
    run = training.fit(model, args, train, held)
    metrics = training.run_metrics(model, args, train, held, run)
    # Shards below 16 MiB so the files come back from the GPU machine; merge_shards.py joins them.
    training.save_best(model, run, args.out, max_shard_size="12MB")
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}), flush=True)


if __name__ == "__main__":
    main()
