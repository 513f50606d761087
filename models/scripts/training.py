"""What the reference models' training scripts share: data, the training loop, early stopping, saving.

``train.py`` (the dense ``quantkit-tiny``) and ``train_moe.py`` (``quantkit-tiny-moe``) differ only in the model
they build and in what they report about it; the data (the same tokenizer, training split and held-out split),
the optimiser, the schedule, the held-out evaluation and the stopping rule are these, so the two models are
comparable and a change to one applies to both.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer


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


def arg_parser(doc: str | None, **defaults: Any) -> argparse.ArgumentParser:
    """The flags every training script takes; ``defaults`` overrides a script's own (``max_minutes=3.0``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.set_defaults(**defaults)
    return ap


def data(args: argparse.Namespace) -> tuple[Tokenizer, torch.Tensor, torch.Tensor]:
    """The tokenizer and the training and held-out windows (the held-out ones on ``args.device``)."""
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    train = windows(token_stream(args.train, tok), args.seq_len)
    held = windows(token_stream(args.heldout, tok), args.seq_len).to(args.device)
    print(f"train windows {tuple(train.shape)} ({train.numel()} tokens), heldout {tuple(held.shape)}", flush=True)
    return tok, train, held


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """The config's BOS/EOS/pad ids (pad is EOS: batches are full windows, never padded)."""
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}


def deterministic() -> None:
    """Deterministic kernels where torch has them, a warning where it has none (never a failed run).

    Needed where gradients or outputs are accumulated with atomics on the GPU, as the experts' ``index_add_``
    is; the CUDA workspace setting must be in place before cuBLAS starts.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


@dataclass
class Run:
    """What a training run produced: the best state (by held-out loss, bf16 on the CPU) and its record."""

    best_state: dict[str, torch.Tensor]
    best_loss: float
    best_step: int
    steps: int
    stopped: str
    history: list[dict] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def train_loss_at_best(self) -> float:
        return next(h["train_loss"] for h in self.history if h["step"] == self.best_step)


def heldout_loss(model: torch.nn.Module, held: torch.Tensor, device: str) -> float:
    """Mean next-token cross-entropy over the held-out windows (bf16 autocast, as in training)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
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


def fit(model: torch.nn.Module, args: argparse.Namespace, train: torch.Tensor, held: torch.Tensor) -> Run:
    """AdamW with warm-up and cosine decay, bf16 autocast, clipped gradients; the held-out loss every
    ``eval_every`` steps decides the best state and stops the run after ``patience`` evaluations without
    improvement (or at ``max_steps``, or past ``max_minutes`` as a safety net).

    The loss is the model's own (``labels=x``), so a mixture of experts adds its router's load-balancing loss;
    that part is recorded separately as ``aux_loss``.
    """
    device = args.device
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    best, best_step, bad, step = float("inf"), 0, 0, 0
    history: list[dict] = []
    start = time.time()
    order = torch.randperm(train.shape[0], generator=gen)
    pos = 0
    best_state: dict[str, torch.Tensor] = {}
    stopped = "max_steps"
    while step < args.max_steps:
        if pos + args.batch > order.numel():
            order, pos = torch.randperm(train.shape[0], generator=gen), 0
        x = train[order[pos:pos + args.batch]].to(device, non_blocking=True)
        pos += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_every == 0:
            record = {"step": step, "train_loss": out.loss.item()}
            if getattr(out, "aux_loss", None) is not None:
                record["aux_loss"] = out.aux_loss.item()
            hl = heldout_loss(model, held, device)
            record.update(heldout_loss=hl, seconds=round(time.time() - start, 1))
            history.append(record)
            print(f"step {step} train {record['train_loss']:.4f} heldout {hl:.4f} ({time.time() - start:.0f}s)",
                  flush=True)
            if hl < best - 1e-4:
                best, best_step, bad = hl, step, 0
                best_state = {k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in model.state_dict().items()}
            else:
                bad += 1
                if bad >= args.patience:
                    print("held-out loss stopped improving", flush=True)
                    stopped = "patience"
                    break
            if time.time() - start > args.max_minutes * 60:
                print("time budget reached", flush=True)
                stopped = "time budget"
                break
    return Run(best_state, best, best_step, step, stopped, history, round(time.time() - start, 1))


def run_metrics(model: torch.nn.Module, args: argparse.Namespace, train: torch.Tensor, held: torch.Tensor,
                run: Run) -> dict[str, Any]:
    """The training record every reference model's metrics.json starts with."""
    import transformers

    device = args.device
    return {
        "parameters": sum(p.numel() for p in model.parameters()), "seq_len": args.seq_len, "batch": args.batch,
        "lr": args.lr, "warmup": args.warmup, "max_steps": args.max_steps, "eval_every": args.eval_every,
        "patience": args.patience, "seed": args.seed, "train_tokens_per_epoch": int(train.numel()),
        "heldout_tokens": int(held.numel()), "steps_run": run.steps, "best_step": run.best_step,
        "tokens_seen_at_best": run.best_step * args.batch * args.seq_len, "best_heldout_loss": run.best_loss,
        "best_heldout_ppl": math.exp(run.best_loss), "train_loss_at_best": run.train_loss_at_best,
        "stopped": run.stopped, "wall_seconds": run.wall_seconds, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "history": run.history, "transformers": transformers.__version__,
    }


def save_best(model: torch.nn.Module, run: Run, out: Path, max_shard_size: str) -> None:
    """The best state, in bf16, with save_pretrained (transformers' own layout, which every engine reads)."""
    model = model.to(torch.bfloat16)
    model.load_state_dict(run.best_state)
    model.config.dtype = torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
