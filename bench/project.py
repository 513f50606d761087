"""What quantizing a 70B and a 405B model takes on one H200 with quantkit's defaults (issue 16 item 5), projected
from measured runs of the 70B width with 4 and 8 of its 80 layers.

The device's 64 GiB disk cannot hold a 141 GB checkpoint, so the runs are the ``70b-4l`` and ``70b-8l`` shapes
(``bench/shapes.py``), quantkit only, one method at a time:

    python3 bench/quantize_cost.py --shape 70b-4l --samples 32 --seq-len 2048 --methods gptq,awq --tools quantkit
    python3 bench/quantize_cost.py --shape 70b-8l --samples 32 --seq-len 2048 --methods gptq,awq --tools quantkit
    python3 bench/project.py      # reads bench/results/quantize_cost_70b-{4,8}l.json, writes project_70b.{md,json}

The two shapes differ only in their layer count, so for each figure x, per layer = (x8 - x4) / 4 and the rest,
fixed = x4 - 4 x per layer, does not grow with depth (start-up, the embeddings and ``lm_head``, the tokenizer).
A model of N such layers then costs fixed + N x per layer: wall time, the quantize step, peak host RSS (all of it
and its anonymous part, what must fit in RAM) and output bytes. Peak GPU memory does not grow with depth (one layer
is on the GPU at a time), so it is the larger of the two runs. For the 405B (hidden 16384, intermediate 53248, 126
layers) each per-layer figure is scaled by how much more a 405B layer is than a 70B one: its calibration FLOPs
(``cost_model.estimate``) for time, its parameters for memory and bytes; peak GPU memory by the parameters of a
layer too. Disk is the bf16 source plus the output beside it. The ratios are assumptions and the table says so;
the 70B figures rest on measurements only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_model  # noqa: E402
import meta  # noqa: E402
from shapes import SHAPES  # noqa: E402

GROWS = ("wall_s", "quantize_s", "peak_rss_bytes", "peak_anon_rss_bytes", "output_bytes")
TARGETS = {"70b": 80, "405b": 126}
TIME_KEYS = ("wall_s", "quantize_s")


def layer_params(shape: str) -> int:
    return sum(i * o * n for _, i, o, n in cost_model.linears(SHAPES[shape]))


def fit(short: dict[str, Any], long: dict[str, Any], layers: tuple[int, int] = (4, 8)) -> dict[str, Any]:
    """Per-layer and fixed parts of each figure from two runs that differ only in depth."""
    a, b = layers
    out: dict[str, Any] = {"per_layer": {}, "fixed": {}}
    for key in GROWS:
        if short.get(key) is None or long.get(key) is None:
            continue
        per = (long[key] - short[key]) / (b - a)
        out["per_layer"][key] = per
        out["fixed"][key] = short[key] - a * per
    out["peak_gpu_bytes"] = max(short.get("peak_gpu_bytes") or 0, long.get("peak_gpu_bytes") or 0)
    return out


def project(f: dict[str, Any], target: str, method: str, samples: int, seq_len: int) -> dict[str, Any]:
    """fixed + N x per layer for ``target``, each per-layer figure scaled from a 70B layer to the target's."""
    n = TARGETS[target]
    modelled = method if method in cost_model.MODELLED else "gptq"  # AWQ's FLOPs follow the forward passes
    flops = {s: cost_model.estimate(SHAPES[s], modelled, samples, seq_len) for s in ("70b", target)}
    per_flop = [(flops[s]["forward_flops"] + flops[s]["hessian_flops"] + flops[s]["solve_flops"])
                / SHAPES[s].config()["num_hidden_layers"] for s in ("70b", target)]
    time_ratio = per_flop[1] / per_flop[0]
    size_ratio = layer_params(target) / layer_params("70b")
    embed_ratio = SHAPES[target].config()["hidden_size"] / SHAPES["70b"].config()["hidden_size"]
    row: dict[str, Any] = {"target": target, "layers": n, "method": method,
                           "layer_time_ratio": round(time_ratio, 3), "layer_size_ratio": round(size_ratio, 3)}
    for key, per in f["per_layer"].items():
        ratio = time_ratio if key in TIME_KEYS else size_ratio
        fixed = f["fixed"][key] * (1 if key in TIME_KEYS else embed_ratio)
        row[key] = fixed + n * per * ratio
    row["peak_gpu_bytes"] = f["peak_gpu_bytes"] * size_ratio
    row["source_bytes"] = 2 * cost_model.parameters(SHAPES[target])
    row["disk_bytes"] = row["source_bytes"] + row.get("output_bytes", 0)
    return row


def runs(path: Path) -> dict[str, dict[str, Any]]:
    """quantkit's run per method from a quantize_cost result file."""
    data = json.loads(path.read_text())
    return {m: tools["quantkit"] for m, tools in data["runs"].items() if tools.get("quantkit", {}).get("rc") == 0}


def gb(x: float) -> str:
    return f"{x / 1e9:,.{1 if abs(x) < 10e9 else 0}f} GB"


def host_fit(row: dict[str, Any], machine: dict[str, Any]) -> str:
    """Whether the host that measured the runs could make this model: its RAM against the peak host RSS (the
    whole model is held in host memory while one layer at a time is on the GPU)."""
    ram = machine.get("memory_bytes")
    if not ram:
        return "-"
    need = row.get("peak_rss_bytes", 0)
    return "yes" if need <= ram else f"no: {gb(need)} of RAM needed, {ram / 2**30:.0f} GiB there"


def markdown(rows: list[dict[str, Any]], fits: dict[str, dict[str, Any]], measured: dict[str, Any], cmd: str,
             note: str | None) -> str:
    lines = ["# 70B and 405B on one H200, projected from the 70B width with 4 and 8 layers", "",
             meta.md_header({**measured, "command": cmd}).rstrip() + " (date, machine, versions: the measured runs')",
             f"- calibration: {measured['samples']} x {measured['seq_len']} tokens; quantkit's defaults",
             *([f"- note: {note}"] if note else []), "",
             "Measured, per layer of the 70B width (from the 8-layer run minus the 4-layer run, over 4):", "",
             "| method | wall per layer | quantize step per layer | host RSS per layer (anonymous) | output per layer "
             "| fixed wall | peak GPU |", "|---|---|---|---|---|---|---|"]
    for method, f in fits.items():
        p, x = f["per_layer"], f["fixed"]
        lines.append(f"| {method} | {p.get('wall_s', 0):.1f} s | {p.get('quantize_s', 0):.1f} s | "
                     f"{gb(p.get('peak_rss_bytes', 0))} ({gb(p.get('peak_anon_rss_bytes', 0))}) | "
                     f"{gb(p.get('output_bytes', 0))} | {x.get('wall_s', 0):.0f} s | "
                     f"{f['peak_gpu_bytes'] / 2**30:.1f} GiB |")
    lines += ["", "Projected (70B: measured per-layer figures x 80; 405B: scaled by a layer's FLOPs for time and its "
              "parameters for memory, an assumption):", "",
              "| model | method | wall | host RSS (anonymous) | peak GPU | disk (source + output) | fits the "
              "measuring host's RAM |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['method']} | {r['wall_s'] / 60:.0f} min | {gb(r.get('peak_rss_bytes', 0))} "
                     f"({gb(r.get('peak_anon_rss_bytes', 0))}) | {r['peak_gpu_bytes'] / 2**30:.0f} GiB | "
                     f"{gb(r['disk_bytes'])} | {host_fit(r, measured['machine'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", type=Path, default=meta.RESULTS / "quantize_cost_70b-4l.json")
    ap.add_argument("--long", type=Path, default=meta.RESULTS / "quantize_cost_70b-8l.json")
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS)
    ap.add_argument("--name", default="project_70b")
    ap.add_argument("--note", help="a line for the table's header (how the runs differed from the defaults)")
    args = ap.parse_args()
    short, long = runs(args.short), runs(args.long)
    meta_short = json.loads(args.short.read_text())
    samples, seq_len = meta_short["samples"], meta_short["seq_len"]
    fits = {m: fit(short[m], long[m]) for m in short if m in long}
    if not fits:
        sys.exit(f"no method with a successful quantkit run in both {args.short} and {args.long}")
    rows = [project(f, t, m, samples, seq_len) for m, f in fits.items() for t in TARGETS]
    cmd = " ".join(["python3", *sys.argv])
    # where and when the runs were measured, not where this arithmetic runs
    measured = {"date": meta_short.get("date", "-"), "machine": meta_short.get("machine", {}),
                "versions": meta_short.get("versions", {}), "samples": samples, "seq_len": seq_len}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = {"command": cmd, "measured": measured, "note": args.note, "fits": fits, "projections": rows}
    md = markdown(rows, fits, measured, cmd, args.note)
    (args.results_dir / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.results_dir / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
