"""Train the reference model ``quantkit-tiny`` (Llama architecture, ~10.5 M parameters) on the training split.

Shape: hidden 256, 8 layers, 4 heads of 64, 2 KV heads, intermediate 768, vocab 8192, untied embeddings.
Every quantized dimension (256, 128, 768) divides by 128 for group quantization and by 256 where GGUF K-quants
need it (256, 768; 128-wide K/V rows fall back the way llama.cpp does).

Training stops when the held-out loss has not improved for ``--patience`` evaluations, and the best checkpoint
(by held-out loss) is saved in bf16 with ``metrics.json`` describing the run. Deterministic for a given seed,
GPU and software versions.

Usage (on a GPU, from the repository root, after prepare_corpus.py and train_tokenizer.py)::

    python models/scripts/train.py --train .train/train.jsonl.gz --heldout calibration/heldout.jsonl.gz \
        --tokenizer models/quantkit-tiny --out /tmp/quantkit-tiny
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM


def token_stream(path: Path, tok: Tokenizer) -> torch.Tensor:
    """Every document as BOS + tokens + EOS, concatenated (BOS comes from the tokenizer's post-processor)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    eos = tok.token_to_id("<|end_of_text|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, default=Path(".train/train.jsonl.gz"))
    ap.add_argument("--heldout", type=Path, default=Path("calibration/heldout.jsonl.gz"))
    ap.add_argument("--tokenizer", type=Path, default=Path("models/quantkit-tiny"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--max-minutes", type=float, default=7.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = args.device
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    train = windows(token_stream(args.train, tok), args.seq_len)
    held = windows(token_stream(args.heldout, tok), args.seq_len).to(device)
    print(f"train windows {tuple(train.shape)} ({train.numel()} tokens), heldout {tuple(held.shape)}", flush=True)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|end_of_text|>"),
        pad_token_id=tok.token_to_id("<|end_of_text|>"), initializer_range=0.02,
    )
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    @torch.no_grad()
    def heldout_loss() -> float:
        model.eval()
        total, count = 0.0, 0
        for i in range(0, held.shape[0], 16):
            x = held[i:i + 16]
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
        model.train()
        return total / count

    gen = torch.Generator().manual_seed(args.seed)
    best, best_step, bad, step, tokens_seen = float("inf"), 0, 0, 0, 0
    history: list[dict] = []
    start = time.time()
    order = torch.randperm(train.shape[0], generator=gen)
    pos = 0
    best_state = None
    train_loss = float("nan")
    while step < args.max_steps:
        if pos + args.batch > order.numel():
            order, pos = torch.randperm(train.shape[0], generator=gen), 0
        x = train[order[pos:pos + args.batch]].to(device, non_blocking=True)
        pos += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += x.numel()
        if step % args.eval_every == 0:
            train_loss = loss.item()
            hl = heldout_loss()
            history.append({"step": step, "train_loss": train_loss, "heldout_loss": hl,
                            "seconds": round(time.time() - start, 1)})
            print(f"step {step} train {train_loss:.4f} heldout {hl:.4f} ({time.time() - start:.0f}s)", flush=True)
            if hl < best - 1e-4:
                best, best_step, bad = hl, step, 0
                best_state = {k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in model.state_dict().items()}
            else:
                bad += 1
                if bad >= args.patience:
                    print("held-out loss stopped improving", flush=True)
                    break
            if time.time() - start > args.max_minutes * 60:
                print("time budget reached", flush=True)
                break

    model = model.to(torch.bfloat16)
    model.load_state_dict(best_state)
    model.config.dtype = torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    # Shards below 16 MiB so the files come back from the GPU machine; merge_shards.py joins them.
    model.save_pretrained(args.out, max_shard_size="12MB")
    best_train = next(h["train_loss"] for h in history if h["step"] == best_step)
    metrics = {
        "parameters": n_params, "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr,
        "seed": args.seed, "train_tokens_per_epoch": int(train.numel()), "heldout_tokens": int(held.numel()),
        "steps_run": step, "best_step": best_step, "tokens_seen_at_best": best_step * args.batch * args.seq_len,
        "best_heldout_loss": best, "best_heldout_ppl": math.exp(best), "train_loss_at_best": best_train,
        "wall_seconds": round(time.time() - start, 1), "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "history": history,
    }
    import transformers
    metrics["transformers"] = transformers.__version__
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}), flush=True)


if __name__ == "__main__":
    main()
