"""Held-out figures of a mixture-of-experts reference model, and its model card.

:func:`measure` scores the held-out windows (perplexity) and counts, per layer, how many of the routed token
slots each expert received (a token chosen for 2 experts counts once for each): a trained router is skewed, and
that skew is what expert quantization (calibration coverage, per-expert scales) has to cope with.
``train_moe.py`` calls it on the GPU right after training; run as a script it measures a saved model on the CPU
in float32 (minutes for the whole held-out split), optionally adds llama.cpp's perplexity on quantkit's F16 GGUF
conversion (``quantkit gguf`` + ``quantkit eval``), and rewrites ``metrics.json`` and the card.

Usage (from the repository root)::

    python models/scripts/moe_stats.py models/quantkit-tiny-moe            # print the CPU figures
    python models/scripts/moe_stats.py models/quantkit-tiny-moe --llama-cpp --write
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def measure(model: torch.nn.Module, held: torch.Tensor, device: str, batch: int = 16) -> dict[str, Any]:
    """Held-out loss and perplexity over ``held`` (windows of token ids), and each expert's share per layer:
    in bf16 autocast on a GPU (as training evaluates), in float32 on a CPU."""
    routers = {name: mod for name, mod in model.named_modules() if name.endswith("mlp.gate")}
    n_expert = int(model.config.num_experts)
    counts = {name: torch.zeros(n_expert, dtype=torch.long) for name in routers}

    def count(name: str):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            chosen = output[2]  # (tokens, top_k) expert indices
            counts[name] += torch.bincount(chosen.reshape(-1).cpu(), minlength=n_expert)
        return hook

    handles = [mod.register_forward_hook(count(name)) for name, mod in routers.items()]
    model.eval()
    total, scored = 0.0, 0
    try:
        with torch.no_grad():
            for i in range(0, held.shape[0], batch):
                x = held[i:i + batch]
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                    logits = model(input_ids=x).logits.float()
                total += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                           x[:, 1:].reshape(-1), reduction="sum").item()
                scored += x[:, 1:].numel()
    finally:
        for h in handles:
            h.remove()
    shares = {}
    for name, c in counts.items():
        layer = int(name.split(".")[2])
        shares[layer] = [round(v / c.sum().item(), 4) for v in c.tolist()]
    loss = total / scored
    note = f"bf16 autocast on {torch.cuda.get_device_name()}" if device == "cuda" else "float32 on a CPU"
    return {"loss": loss, "ppl": math.exp(loss), "tokens_scored": scored, "windows": int(held.shape[0]),
            "window": int(held.shape[1]), "note": note, "expert_share": shares}


def _effective(shares: list[float]) -> float:
    """exp(entropy) of the routing distribution: how many experts it is worth, from 1 up to all of them."""
    return math.exp(-sum(s * math.log(s) for s in shares if s > 0))


def card(m: dict[str, Any]) -> str:
    """The model card, from ``metrics.json`` as train_moe.py (and this script) write it."""
    moe, held = m["moe"], m["heldout"]
    rows = []
    for layer, shares in sorted(held["expert_share"].items(), key=lambda kv: int(kv[0])):
        cells = " | ".join(f"{100 * s:.1f}%" for s in shares)
        rows.append(f"| {layer} | {cells} | {_effective(shares):.2f} |")
    head = " | ".join(str(e) for e in range(moe["experts"]))
    rule = " | ".join("---" for _ in range(moe["experts"] + 2))
    cpu = m.get("heldout_cpu")
    cpu_row = f"\n| held-out perplexity (transformers, {cpu['note']}) | {cpu['ppl']:.2f} |" if cpu else ""
    found = m.get("measured", [])
    measured = "".join(f"\n| {r['engine']} | {r['ppl']:.3f} | {r['top1']:.5f} | {r['kld']:.6f} |" for r in found)
    measured_table = (f"\nMeasured afterwards on a CPU with `{found[0]['command']}` (quantkit's protocol: the "
                      f"held-out split, {found[0]['tokens']:,} tokens scored in {m['seq_len']}-token windows that each start "
                      "with BOS; float32 in transformers, quantkit's F16 GGUF conversion in llama.cpp):\n\n"
                      "| engine | perplexity | top-1 vs transformers | KLD vs transformers |\n| --- | --- | --- | --- |"
                      + measured + "\n") if found else ""
    return f"""---
license: psf-2.0
language: [en]
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3_moe, mixture-of-experts, reference-model, quantkit]
---

# quantkit-tiny-moe

A small real mixture-of-experts language model (Qwen3-MoE architecture) that quantkit trains itself, on the same
openly licensed text and with the same tokenizer as `quantkit-tiny`, so expert quantization, GGUF conversion of
experts and MoE serving are tested on trained routing anywhere, offline. It is not a useful assistant.

## Shape
| field | value |
| --- | --- |
| architecture | `Qwen3MoeForCausalLM` |
| parameters | {m['parameters']:,} |
| hidden / expert intermediate | 256 / {moe['expert_ffn']} |
| layers / heads / KV heads / head dim | {moe['layers']} / 4 / 2 / 64 (q/k RMS norms) |
| experts | {moe['experts']} per layer, {moe['top_k']} chosen per token (softmax router, chosen weights renormalised) |
| vocabulary | 8192, byte-level BPE (the `quantkit-tiny` tokenizer) |
| context | {m['seq_len']} (RoPE, theta 10000) |
| embeddings | tied (keeps the model under 12 MB) |
| dtype | bfloat16 |

Every quantized row (256 values) divides by 128 for group quantization and by 256 for GGUF K-quants.

## Training
`models/scripts/train_moe.py` on one {m['gpu']} (torch {m['torch']}, transformers {m['transformers']}), seed
{m['seed']}: the data, optimiser and stopping rule of `quantkit-tiny` (`models/scripts/training.py`: AdamW,
peak lr {m['lr']} with {m['warmup']} warm-up steps and cosine decay over {m['max_steps']}, batches of
{m['batch']} x {m['seq_len']} tokens, bf16 autocast, held-out loss every {m['eval_every']} steps, stop after
{m['patience']} evaluations without improvement, best checkpoint kept), plus the
router's load-balancing loss at weight {moe['router_aux_loss_coef']}, which keeps every expert in use without
making them equally used. Deterministic kernels; experts in transformers' "{moe['experts_implementation']}"
implementation.

| | |
| --- | --- |
| training tokens per epoch | {m['train_tokens_per_epoch']:,} |
| steps run / best step | {m['steps_run']} / {m['best_step']} (stopped by {m['stopped']}) |
| tokens seen at the best step | {m['tokens_seen_at_best']:,} ({m['tokens_seen_at_best'] / m['train_tokens_per_epoch']:.1f} epochs) |
| train loss at the best step | {m['train_loss_at_best']:.3f} |
| held-out loss ({m['seq_len']}-token windows) | {m['best_heldout_loss']:.3f} |
| **held-out perplexity** (transformers, {held['note']}) | **{held['ppl']:.2f}** |{cpu_row}
| wall time | {m['wall_seconds']:.0f} s |
{measured_table}
## Routing on held-out text
Share of the held-out routed token slots ({held['tokens_scored']:,} tokens x {moe['top_k']} experts) that each
expert received, per layer ({held['note']}); "effective" is exp(entropy) of the shares: {moe['experts']} would
be perfectly balanced, 1 a single expert taking everything.

| layer | {head} | effective |
| {rule} |
{chr(10).join(rows)}

The full loss history is in `metrics.json`; `models/scripts/moe_stats.py` recomputes these figures from the
saved model on a CPU.

## Rebuild it
```bash
python models/scripts/prepare_corpus.py --corpus ../shared/corpus    # the split of quantkit-tiny
python models/scripts/train_moe.py --out /tmp/quantkit-tiny-moe       # on a GPU (a few minutes on an H200)
python models/scripts/moe_stats.py /tmp/quantkit-tiny-moe --llama-cpp --write   # CPU figures, then copy it here
```

## Licence
The training text is the Python Software Foundation's, under the PSF License Agreement
(`calibration/LICENSE-PSF.txt`); the weights are released under the same terms.
"""


def _held_windows(model_dir: Path, heldout: Path, seq_len: int) -> torch.Tensor:
    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import training

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return training.windows(training.token_stream(heldout, tok), seq_len)


def llama_cpp_ppl(model_dir: Path, ctx: int, max_tokens: int | None = None) -> dict[str, Any]:
    """llama.cpp's held-out perplexity on quantkit's F16 GGUF of the model, with transformers as the baseline."""
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "gguf"
        run = [sys.executable, "-m", "quantkit"]
        subprocess.run([*run, "gguf", str(model_dir), str(art), "-t", "F16"], check=True, cwd=ROOT)
        command = ["eval", str(art), "--baseline", str(model_dir), "--dataset", "heldout", "--ctx", str(ctx)]
        if max_tokens:
            command += ["--max-tokens", str(max_tokens)]
        out = subprocess.run([*run, *command, "--json"], cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"quantkit eval exited {out.returncode}:\n{out.stderr[-2000:]}")
    shown = f"models/{model_dir.name}"
    return {"result": json.loads(out.stdout),
            "command": f"quantkit gguf {shown} OUT -t F16; quantkit {' '.join(command[:1] + ['OUT'] + command[2:])}"
                       .replace(str(model_dir), shown)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--heldout", type=Path, default=ROOT / "calibration" / "heldout.jsonl.gz")
    ap.add_argument("--llama-cpp", action="store_true", help="also convert with quantkit and score in llama.cpp")
    ap.add_argument("--max-tokens", type=int, help="score only this many held-out tokens in quantkit eval (a quick check)")
    ap.add_argument("--write", action="store_true", help="update metrics.json and README.md in the model folder")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    metrics_path = args.model / "metrics.json"
    metrics = json.loads(metrics_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, experts_implementation="eager")
    held = _held_windows(args.model, args.heldout, metrics["seq_len"])
    cpu = measure(model, held, "cpu")
    print(json.dumps(cpu, indent=1), flush=True)
    if args.llama_cpp:
        found = llama_cpp_ppl(args.model, metrics["seq_len"], args.max_tokens)
        print(json.dumps(found["result"], indent=1), flush=True)
        metrics["measured"] = _measured_rows(found)
    if args.write:  # the training GPU's figures stay; these are added beside them
        metrics["heldout" if "heldout" not in metrics else "heldout_cpu"] = cpu
        metrics_path.write_text(json.dumps(metrics, indent=1) + "\n")
        (args.model / "README.md").write_text(card(metrics))


def _measured_rows(found: dict[str, Any]) -> list[dict[str, Any]]:
    """quantkit eval's JSON -> one card row per engine (the transformers baseline and llama.cpp's F16)."""
    res = found["result"]
    tokens = res["protocol"]["tokens_scored"]
    return [{"engine": f"{r['engine']['engine']} ({r['format']})", "ppl": r["ppl"], "top1": r["top1"],
             "kld": r["kld"], "tokens": tokens, "command": found["command"]}
            for r in [res["baseline"], *res["results"]]]


if __name__ == "__main__":
    main()
