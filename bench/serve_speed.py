"""Serving speed (issue 10 item 3): time to first token and decode tokens/s at batch 1 and 16 in vLLM, for a bf16
checkpoint and its quantized artifacts, with the kernel vLLM chose and the memory-bandwidth limit beside each.

On the GPU machine, vLLM installed as in ../shared/device/vllm/README.md and wrapped as /tmp/vpy (a script that
sets PYTHONPATH=/tmp/site and runs python3), after ``python bench/quantize_cost.py --shape 8b --keep`` has left
the 8B-shaped source and its quantkit artifacts in /tmp/quantkit-bench-qcost:

    python bench/serve_speed.py /tmp/quantkit-bench-qcost/src-8b /tmp/quantkit-bench-qcost/out-quantkit-* \\
        --python /tmp/vpy

Each checkpoint runs in its own child process in vLLM's Python (CUDA graphs on, prefix caching off so repeated
prompts cost what new ones do), after one warm-up generation at the largest batch:

* TTFT: the median of 5 ``generate`` calls with one fresh prompt of ``--prompt-len`` random token ids and
  ``max_tokens=1`` (prefill plus the first sampled token, offline: no HTTP in the figure).
* decode tok/s at batch B: B fresh prompts generate ``--gen`` tokens (ignore_eos); the time of the same call with
  ``max_tokens=1`` (median of 3) is subtracted, so the figure is B x (gen - 1) tokens over pure decode time.
* limit: a decode step reads every weight once (the input embedding table only one row per sequence, unless tied to
  ``lm_head``), so B x bandwidth / bytes-read-per-step bounds it from above (KV-cache reads ignored, which only
  lowers the real bound). ``--bandwidth`` defaults to the H200's 4.8 TB/s.

Writes bench/results/serve_speed.{json,md} after every checkpoint (the command, machine and versions included).
This parent needs only the standard library and quantkit's source module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

sys.path.insert(0, str(meta.ROOT / "scripts"))
sys.path.insert(0, str(meta.ROOT))
from gpu_vllm_matrix import kernels_in, run_child  # noqa: E402
from quantkit.source import safetensors_header  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e

CHILD = r"""
import json, random, statistics, sys, time
import vllm
from vllm import LLM, SamplingParams

art, prompt_len, gen, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
batches = [int(b) for b in sys.argv[4].split(",")]
llm = LLM(model=art, max_model_len=max_len, gpu_memory_utilization=0.85, enable_prefix_caching=False, seed=0)
cfg = llm.llm_engine.model_config
vocab = cfg.hf_config.vocab_size
rng = random.Random(0)


def prompts(n):
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]} for _ in range(n)]


def timed(n, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    res = llm.generate(prompts(n), sp, use_tqdm=False)
    return time.perf_counter() - t, sum(len(r.outputs[0].token_ids) for r in res)


timed(max(batches), gen)
out = {"vllm": vllm.__version__, "quantization": cfg.quantization, "dtype": str(cfg.dtype),
       "ttft_s": statistics.median(timed(1, 1)[0] for _ in range(5))}
for b in batches:
    first = statistics.median(timed(b, 1)[0] for _ in range(3))
    total, tokens = timed(b, gen)
    out[f"b{b}"] = {"first_token_s": first, "total_s": total, "tokens": tokens,
                    "decode_tok_s": b * (gen - 1) / (total - first)}
print("RESULT " + json.dumps(out), flush=True)
"""


def bytes_per_step(folder: Path) -> tuple[int, int]:
    """(bytes of all weights, bytes a decode step reads): the untied input embedding table is read one row at a
    time, so it is left out of the second."""
    cfg = json.loads((folder / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings"))
    total = read = 0
    for f in sorted(folder.glob("*.safetensors")):
        header, _ = safetensors_header(f)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            n = info["data_offsets"][1] - info["data_offsets"][0]
            total += n
            if tied or not name.endswith("embed_tokens.weight"):
                read += n
    return total, read


def describe(folder: Path) -> str:
    """The checkpoint's format as its config says: compressed-tensors format, another quant_method, or its dtype."""
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg.get("quantization_config")
    if not q:
        return str(cfg.get("torch_dtype") or cfg.get("dtype") or "unquantized")
    return f"{q.get('quant_method')} {q.get('format') or ''}".strip()


def run_one(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    total, read = bytes_per_step(folder)
    row: dict[str, Any] = {"checkpoint": folder.name, "path": str(folder), "format": describe(folder),
                           "weight_bytes": total, "bytes_per_step": read}
    log = args.logs / f"{folder.name}.log"
    argv = [args.python, "-c", CHILD, str(folder), str(args.prompt_len), str(args.gen),
            ",".join(map(str, args.batches)), str(args.max_model_len)]
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")}
    t = time.perf_counter()
    text, rc, result = run_child(argv, env, args.timeout, log)
    row.update(seconds=round(time.perf_counter() - t, 1), rc=rc, log=str(log), kernels=kernels_in(text))
    row.update(result or {})
    if "ttft_s" not in row:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln]
        row["error"] = ((errors or lines or ["no output"])[-1]).strip()[:300]
    for b in args.batches:
        limit = b * args.bandwidth / read
        row[f"limit_b{b}"] = limit
        if f"b{b}" in row:
            row[f"b{b}"]["share_of_limit"] = row[f"b{b}"]["decode_tok_s"] / limit
    return row


def markdown(data: dict[str, Any]) -> str:
    batches = data["batches"]
    lines = ["# Serving speed in vLLM", "", meta.md_header(data),
             f"Prompts of {data['prompt_len']} random token ids, {data['gen']} generated tokens, greedy, prefix "
             f"caching off. Limit = batch x {data['bandwidth'] / 1e12:.1f} TB/s / bytes read per decode step.", "",
             "| checkpoint | format | vLLM quantization | kernel | GiB read per step | TTFT | "
             + " | ".join(f"decode tok/s b{b} | limit b{b}" for b in batches) + " |",
             "|---|---|---|---|---|---|" + "---|---|" * len(batches)]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['checkpoint']} | {r['format']} | failed: `{r['error']}` | | "
                         f"{r['bytes_per_step'] / 2**30:.2f} | |" + " | |" * len(batches))
            continue
        cells = []
        for b in batches:
            m = r.get(f"b{b}") or {}
            cells.append(f"{m['decode_tok_s']:.0f} ({m['share_of_limit']:.0%})" if m else "-")
            cells.append(f"{r[f'limit_b{b}']:.0f}")
        lines.append(f"| {r['checkpoint']} | {r['format']} | {r.get('quantization') or 'none'} | "
                     f"{'; '.join(r.get('kernels') or []) or '-'} | {r['bytes_per_step'] / 2**30:.2f} | "
                     f"{r['ttft_s'] * 1000:.0f} ms | " + " | ".join(cells) + " |")
    lines += ["", "Decode tok/s in brackets: the share of the bandwidth limit reached.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders: the bf16 source and artifacts")
    ap.add_argument("--python", default=sys.executable, help="the Python that has vLLM (default: this one)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s (default: H200, 4.8e12)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per checkpoint")
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/quantkit-bench-serve"))
    args = ap.parse_args()
    missing = [str(c) for c in args.checkpoints if not (c / "config.json").is_file()]
    if missing:
        raise SystemExit(f"not a checkpoint folder (no config.json): {', '.join(missing)}")
    args.logs.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {**meta.header(), "prompt_len": args.prompt_len, "gen": args.gen,
                            "batches": args.batches, "bandwidth": args.bandwidth, "rows": []}
    for folder in args.checkpoints:
        print(f"== {folder.name}", flush=True)
        data["rows"].append(run_one(folder, args))
        meta.write("serve_speed", data, markdown(data), args.results_dir)
        r = data["rows"][-1]
        print(f"   {r.get('error') or {b: r.get(f'b{b}', {}).get('decode_tok_s') for b in args.batches}}", flush=True)


if __name__ == "__main__":
    main()
