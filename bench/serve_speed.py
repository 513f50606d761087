"""Serving speed (issue 10 item 3, issue 14 item 4): time to first token and decode tokens/s at batch 1 and 16 in
vLLM, for a bf16 checkpoint (the "bf16" row) and its quantized artifacts, with the kernel vLLM chose and the
memory-bandwidth limit beside each.

On a machine with a CUDA GPU and vLLM, after ``python bench/quantize_cost.py --shape SHAPE --keep quantkit`` has
left the source and its quantkit artifacts in its --workdir W:

    python3 bench/serve_speed.py W/src-8b W/out-quantkit-* [--kernels]
    python3 bench/serve_speed.py W/src-qwen3-30b-a3b-12l W/out-quantkit-{gptq,fp8-static} --name serve_speed_moe

vLLM's Python is found as quantkit finds it (``--python``, else QUANTKIT_VLLM_PYTHON, else the interpreter of
``vllm`` on PATH, else this one: quantkit/envs.py); ``--vllm-path DIR`` puts a folder vLLM was installed into with
``pip install --target`` on its PYTHONPATH.

Each checkpoint runs in its own child process in vLLM's Python (quantkit/engines/vllm/_speed_worker.py through
quantkit.engines.vllm.kernel_sweep: CUDA graphs on, prefix caching off so repeated prompts cost what new ones do), after
one warm-up generation at the largest batch:

* TTFT: the median of 5 ``generate`` calls with one fresh prompt of ``--prompt-len`` random token ids and
  ``max_tokens=1`` (prefill plus the first sampled token, offline: no HTTP in the figure).
* decode tok/s at batch B: B fresh prompts generate ``--gen`` tokens (ignore_eos), three times; from the median
  time, the time of the same call with ``max_tokens=1`` (median of 3) is subtracted, so the figure is B x (gen - 1)
  tokens over pure decode time (each run's figure is in the JSON, ``decode_tok_s_runs``).
* limit: B x bandwidth / bytes-read-per-step bounds it from above (bench/step_bytes.py): a dense model reads every
  weight once (the input embedding table only one row per sequence, unless tied to ``lm_head``); an MoE model
  reads its attention, norms, routers and ``lm_head`` and, of its routed experts, top-k per layer at batch 1 and at
  batch B the expected number of distinct experts B tokens hit under uniform routing (the table says so; the limit
  if no two tokens shared an expert, min(E, B x top-k), is in the JSON). KV-cache reads are ignored, which only
  lowers the real bound. The bandwidth is ``--bandwidth`` where given, else the serving GPU's (the device vLLM's
  process names, else nvidia-smi's first) from bench/meta.py's ``BANDWIDTH`` (H100 SXM 80GB HBM3 3.35 TB/s, H200
  4.8 TB/s): a GPU the table lacks, or no GPU seen at all, gets no limit and no share (None; "-" in the table, the
  reason beside "Limit =" in the markdown), never another card's. Each row records the figure and whose it is
  (``bandwidth``, ``bandwidth_of``).
* ``--tp 1,2`` measures each checkpoint with vLLM's tensor parallelism over 1 and 2 GPUs (a table of the
  ratios follows the main one).
* CUDA graphs are captured for the measured batch sizes only (``--capture-all`` for vLLM's default list): the same
  graphs serve batch 1 and 16 either way, and capturing ~60 sizes of a 16 GB model costs start-up time a short
  GPU session does not have.
* the kernel: what vLLM's log says it used. ``--kernels`` also runs every other linear (and MoE) kernel vLLM could
  use for the checkpoint (quantkit.engines.vllm.kernels) and reports the fastest configuration's ``vllm serve`` command.

Writes bench/results/NAME.{json,md} (``--name``, default serve_speed) after every checkpoint (the command, machine
and versions included). The work folder ``--workdir`` is ``bench/serve_speed`` under quantkit's cache root unless
given (quantkit/cache.py: ``$QUANTKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantkit``, else ``~/.cache/quantkit``);
vLLM's log and the request of each run go to its ``logs/`` (``--logs`` names another folder). This parent needs only
the standard library and quantkit's source module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

sys.path.insert(0, str(meta.ROOT))
from quantkit import cache  # noqa: E402
from quantkit.engines import registry  # noqa: E402
from quantkit.engines.vllm import kernel_sweep, kernels  # noqa: E402
from quantkit.formats.names import VLLM  # noqa: E402
from step_bytes import StepBytes, count  # noqa: E402

def describe(folder: Path) -> str:
    """The checkpoint's format as its config says: compressed-tensors format, another quant_method, or its dtype."""
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg.get("quantization_config")
    if not q:
        return str(cfg.get("torch_dtype") or cfg.get("dtype") or "unquantized")
    return f"{q.get('quant_method')} {q.get('format') or ''}".strip()


def label(folder: Path) -> str:
    """The row's name: "bf16" (or the dtype) for an unquantized checkpoint, quantkit's method and scheme for its
    artifacts ("gptq W4A16"), else the folder's name."""
    cfg = json.loads((folder / "config.json").read_text())
    if not cfg.get("quantization_config"):
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
        return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype or folder.name)
    try:
        m = json.loads((folder / "quantkit.json").read_text())
    except (OSError, json.JSONDecodeError):
        return folder.name
    return f"{m.get('method')} {(m.get('quantization') or {}).get('scheme') or ''}".strip()


def limit_bandwidth(given: float | None, served: str | None) -> tuple[float | None, str]:
    """The memory bandwidth a row's limits are computed against, and whose it is: ``--bandwidth`` where given, else
    the GPU that served (``served``: the name vLLM's process gave it, else nvidia-smi's first GPU) from bench/meta.py's
    table. None for one the table lacks, and None where no GPU is seen at all: a limit against a card that did not
    serve is wrong, not approximate (the H100's shares were taken against the H200's 4.8 TB/s)."""
    if given:
        return given, "--bandwidth"
    if served is None:
        return None, "no GPU seen: no limit known"
    found = meta.bandwidth(served)
    return found, served if found else f"{served}, not in bench/meta.py's BANDWIDTH: no limit known"


def bandwidth_text(rows: list[dict[str, Any]]) -> str:
    """The bandwidths the rows' limits were computed against, each with whose it is (one, on one machine); where none
    is known, why (its ``bandwidth_of`` says: no GPU seen, or one bench/meta.py's table lacks), so the table's "-"
    limits are explained."""
    seen = dict.fromkeys((r.get("bandwidth"), r.get("bandwidth_of")) for r in rows)
    return "; ".join(f"{bw / 1e12:.2f} TB/s ({of})" if bw else str(of) for bw, of in seen)


def limit_cell(row: dict[str, Any], b: int) -> str:
    """The limit at batch ``b``, with the experts it assumes read per MoE layer; "-" where no bandwidth is known."""
    if row.get(f"limit_b{b}") is None:
        return "-"
    text = f"{row[f'limit_b{b}']:.0f}"
    hit = row.get(f"experts_hit_b{b}")
    if hit is None:
        return text
    how = "top-k" if b == 1 else "expected"
    return f"{text} ({hit:.3g}/{row['num_experts']} experts, {how})"


def log_stem(folder: Path, tp: int) -> str:
    return folder.name if tp == 1 else f"{folder.name}-tp{tp}"


def checkpoint_row(folder: Path, sb: StepBytes, tp: int) -> dict[str, Any]:
    """A row's description of the checkpoint, before anything is served: its label, format and the bytes a step
    reads (``sb``)."""
    row: dict[str, Any] = {"checkpoint": label(folder), "folder": folder.name, "path": str(folder),
                           "format": describe(folder), "tp": tp,
                           "weight_bytes": sb.total, "bytes_per_step": sb.read(1)}
    if sb.moe:
        row.update(num_experts=sb.num_experts, top_k=sb.top_k, expert_bytes=sb.experts, always_bytes=sb.always)
    return row


def run_one(folder: Path, args: argparse.Namespace, tp: int = 1) -> dict[str, Any]:
    """One checkpoint on ``tp`` GPUs: vLLM's default configuration, or (``--kernels``) every kernel configuration.

    With tensor parallelism each GPU reads its 1/tp share of the weights per step, so the limit is tp times one
    GPU's bandwidth over the same bytes. The bandwidth is the serving GPU's unless ``args.bandwidth`` is given
    (``limit_bandwidth``); with none known, the limits and shares are None."""
    sb: StepBytes = count(folder)
    row = checkpoint_row(folder, sb, tp)
    engine_args: dict[str, Any] = {}
    if tp > 1:
        engine_args["tensor_parallel_size"] = tp
    bench = kernel_sweep.Bench(batches=tuple(args.batches), prompt_len=args.prompt_len, gen=args.gen,
                               max_model_len=args.max_model_len, gpu_memory_utilization=0.85, engine_args=engine_args,
                               capture_measured_only=not args.capture_all)
    env = {"VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")}
    runtime = kernel_sweep.Runtime(args.python, {**env, **({"PYTHONPATH": args.vllm_path} if args.vllm_path else {})})
    if args.kernels:
        sweep = kernel_sweep.sweep(folder, bench, runtime, args.logs / log_stem(folder, tp), timeout=args.timeout)
        row["sweep"] = sweep.to_json()
        m = next(x for x in sweep.measurements if x.configuration.kind == "default")
    else:
        config = kernels.configurations(kernels.read_quantization(folder))[0]
        m = kernel_sweep.run_configuration(folder, config, bench, runtime, args.logs / f"{log_stem(folder, tp)}.log",
                                           args.timeout)
    return measured(row, m, sb, tp, args.batches, args.bandwidth)


def measured(row: dict[str, Any], m: kernels.Measurement, sb: StepBytes, tp: int, batches: list[int],
             bandwidth: float | None) -> dict[str, Any]:
    """``row`` with one vLLM measurement's figures: TTFT, decode tok/s at each batch, and each batch's limit and share
    of it against ``bandwidth`` (``--bandwidth``), else the serving GPU's (:func:`limit_bandwidth`)."""
    row.update(seconds=m.seconds, log=m.log, kernels=m.facts.kernels(), **m.extra)
    if m.status == "ok":
        row["ttft_s"] = m.ttft_s
    else:
        row["error"] = f"{m.status}: {m.error}"[:300]
    served = None if bandwidth else row.get("gpu") or next((meta.gpu_name(g) for g in meta.gpus()), None)
    bw, row["bandwidth_of"] = limit_bandwidth(bandwidth, served)
    row["bandwidth"] = bw
    for b in batches:
        limit = b * tp * bw / sb.read(b) if bw else None
        row[f"limit_b{b}"] = limit
        row[f"bytes_per_step_b{b}"] = sb.read(b)
        if sb.moe:
            row[f"experts_hit_b{b}"] = sb.experts_hit(b)
            row[f"limit_b{b}_all_distinct"] = b * tp * bw / sb.read(b, bound=True) if bw else None
        if str(b) in m.decode_tok_s:
            tok_s = m.decode_tok_s[str(b)]
            row[f"b{b}"] = {"decode_tok_s": tok_s, "share_of_limit": tok_s / limit if limit else None}
    return row


def markdown(data: dict[str, Any]) -> str:
    batches = data["batches"]
    lines = ["# Serving speed in vLLM", "", meta.md_header(data),
             f"Prompts of {data['prompt_len']} random token ids, {data['gen']} generated tokens, greedy, prefix "
             f"caching off. Limit = batch x the serving GPU's memory bandwidth ({bandwidth_text(data['rows'])}) / "
             "bytes read per decode step (GiB read per step: at batch 1).", "",
             "| checkpoint | format | tp | vLLM quantization | kernel | GiB read per step | TTFT | "
             + " | ".join(f"decode tok/s b{b} | limit b{b}" for b in batches) + " |",
             "|---|---|---|---|---|---|---|" + "---|---|" * len(batches)]
    names = [(r["checkpoint"], r.get("tp", 1)) for r in data["rows"]]
    for r in data["rows"]:
        unique = names.count((r["checkpoint"], r.get("tp", 1))) == 1
        name = r["checkpoint"] if unique else f"{r['checkpoint']} ({r['folder']})"
        cells = []
        for b in batches:
            m = r.get(f"b{b}") or {}
            share = f" ({m['share_of_limit']:.0%})" if m and m.get("share_of_limit") is not None else ""
            cells.append(f"{m['decode_tok_s']:.0f}{share}" if m else "-")
            cells.append(limit_cell(r, b))
        if "error" in r:
            lines.append(f"| {name} | {r['format']} | {r.get('tp', 1)} | `{r['error']}` | | "
                         f"{r['bytes_per_step'] / 2**30:.2f} | "
                         "- | " + " | ".join(cells) + " |")
            continue
        lines.append(f"| {name} | {r['format']} | {r.get('tp', 1)} | {r.get('quantization') or 'none'} | "
                     f"{'; '.join(r.get('kernels') or []) or '-'} | {r['bytes_per_step'] / 2**30:.2f} | "
                     f"{r['ttft_s'] * 1000:.0f} ms | " + " | ".join(cells) + " |")
    lines += ["", "Decode tok/s in brackets: the share of the bandwidth limit reached. With tensor parallelism "
              "(tp > 1) the limit is tp GPUs' bandwidth over the same bytes."]
    speedups = tp_speedups(data["rows"], batches)
    if speedups:
        lines += ["", "| checkpoint | " + " | ".join(f"tp=N / tp=1 at b{b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)] + speedups
    if any(r.get("num_experts") for r in data["rows"]):
        lines.append("MoE rows: a step reads attention, norms, routers and lm_head, and of the routed experts top-k "
                     "per layer at batch 1; at larger batches the limit assumes the expected number of distinct "
                     "experts under uniform routing, E(1-(1-k/E)^B) (random weights route near-uniformly). If no two "
                     "tokens shared an expert, min(E, B x k) would be read: `limit_bB_all_distinct` in the JSON.")
    lines.append("")
    for r in data["rows"]:
        sweep = r.get("sweep")
        if sweep:
            ms = [kernels.Measurement.from_json(m) for m in sweep["measurements"]]
            choice = kernels.choose(ms)
            lines += [f"## Kernels: {r['checkpoint']}", "", kernels.markdown(ms, choice, tuple(batches))]
            if sweep.get("command"):
                lines += [f"Serve with: `{sweep['command']['shell']}`", ""]
    return "\n".join(lines)


def tp_speedups(rows: list[dict[str, Any]], batches: list[int]) -> list[str]:
    """Decode tok/s on more GPUs over the same checkpoint on one, for every checkpoint measured both ways."""
    one = {r["folder"]: r for r in rows if r.get("tp", 1) == 1}
    out = []
    for r in rows:
        base = one.get(r["folder"])
        if r.get("tp", 1) == 1 or not base:
            continue
        cells = [f"{r[f'b{b}']['decode_tok_s'] / base[f'b{b}']['decode_tok_s']:.2f}x"
                 if r.get(f"b{b}") and base.get(f"b{b}") else "-" for b in batches]
        out.append(f"| {r['checkpoint']} (tp={r['tp']}) | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = meta.serving_parser(__doc__, checkpoints="checkpoint folders: the bf16 source and artifacts",
                             engine="vLLM's", engine_path="--vllm-path", timeout=600,
                             timeout_help="seconds per vLLM start", name="serve_speed",
                             name_help="result file name (NAME.json, NAME.md)")
    ap.add_argument("--kernels", action="store_true", help="also measure every other kernel vLLM could use")
    ap.add_argument("--batches", type=meta.int_list, default=[1, 16])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--bandwidth", type=float, help="bytes/s [default: the serving GPU's, bench/meta.py's BANDWIDTH]")
    ap.add_argument("--capture-all", action="store_true", help="let vLLM capture its default CUDA graph sizes")
    ap.add_argument("--workdir", type=Path, default=cache.root() / "bench" / "serve_speed",
                    help="work folder (vLLM's logs and requests) [default: %(default)s, under quantkit's cache root]")
    ap.add_argument("--logs", type=Path, help="vLLM's logs and requests [default: WORKDIR/logs]")
    ap.add_argument("--tp", type=meta.int_list, default=[1],
                    help="tensor-parallel sizes, each checkpoint measured at each (e.g. 1,2)")
    args = ap.parse_args()
    args.logs = args.logs or args.workdir / "logs"
    args.python = registry.get(VLLM).find_python(args.python).python
    missing = [str(c) for c in args.checkpoints if not (c / "config.json").is_file()]
    if missing:
        raise SystemExit(f"not a checkpoint folder (no config.json): {', '.join(missing)}")
    args.logs.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {**meta.header(), "prompt_len": args.prompt_len, "gen": args.gen,
                            "batches": args.batches, "rows": []}
    for folder, tp in ((f, tp) for f in args.checkpoints for tp in args.tp):
        print(f"== {folder.name} tp={tp}", flush=True)
        data["rows"].append(run_one(folder, args, tp))
        meta.write(args.name, data, markdown(data), args.results_dir)
        r = data["rows"][-1]
        print(f"   {r.get('error') or {b: r.get(f'b{b}', {}).get('decode_tok_s') for b in args.batches}}", flush=True)


if __name__ == "__main__":
    main()
