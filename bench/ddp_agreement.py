"""Distributed calibration changes nothing but the time (issue 18 item 1): GPTQ and AWQ of the reference model with
``--num-gpus 2`` against ``--num-gpus 1``, scored on its held-out text.

    python3 bench/ddp_agreement.py --results-dir bench/results/h200x2      # on a machine with 2 GPUs

For each method three artifacts are made with the real CLI from the same calibration set (128 x 512 tokens of the
shipped calibration text, quantkit's defaults): one GPU with seed 0, one GPU with seed 1, two GPUs with seed 0.
All are scored in one ``quantkit eval`` (the baseline's logits computed once, same windows for all). With two GPUs
each rank calibrates half of the samples and llm-compressor all-reduces what the algorithm accumulates (GPTQ's
Hessians, AWQ's activation statistics), so the result may differ from one GPU's by summation order only. The two
seeds give the run-to-run noise a user sees from calibration sampling alone; the check is that the two-GPU artifact
is as close to the one-GPU one as that noise (KLD difference at most the seed-to-seed difference, or 5% of the KLD
where the noise is smaller).

Writes NAME.{json,md} (default ddp_agreement) into ``--results-dir``; exit 1 when a method disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

TINY = meta.ROOT / "models" / "quantkit-tiny"
RUNS = (("1 GPU, seed 0", 1, 0), ("1 GPU, seed 1", 1, 1), ("2 GPUs, seed 0", 2, 0))
FLOOR = 0.05  # relative KLD difference always tolerated


def quantkit(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True,
                          cwd=meta.ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, round(time.perf_counter() - t0, 2)


def make(method: str, gpus: int, seed: int, out: Path) -> dict[str, Any]:
    proc, wall = quantkit(method, str(TINY), str(out), "--num-gpus", str(gpus), "--seed", str(seed), "--force",
                          "--json")
    row: dict[str, Any] = {"method": method, "gpus": gpus, "seed": seed, "path": str(out), "rc": proc.returncode,
                           "wall_s": wall}
    if proc.returncode:
        row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        return row
    m = json.loads(proc.stdout)[0]
    row["tokens_sha256"] = (m.get("calibration") or {}).get("tokens_sha256")
    row["quantize_s"] = (m.get("timings") or {}).get("quantize")
    return row


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the two-GPU artifact is within the one-GPU seed-to-seed noise of the one-GPU artifact."""
    s0, s1, x2 = (next((r for r in rows if (r["gpus"], r["seed"]) == k), None) for k in ((1, 0), (1, 1), (2, 0)))
    if not all(r and r.get("kld") is not None for r in (s0, s1, x2)):
        return {"ok": False, "why": "a run or its evaluation failed"}
    noise = abs(s1["kld"] - s0["kld"])
    diff = abs(x2["kld"] - s0["kld"])
    bound = max(noise, FLOOR * s0["kld"])
    return {"ok": diff <= bound, "kld_diff": diff, "seed_noise": noise, "bound": bound,
            "top1_diff": x2["top1"] - s0["top1"]}


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Distributed calibration: 2 GPUs against 1 on the reference model", "", meta.md_header(data),
             "Artifacts made by `quantkit METHOD models/quantkit-tiny OUT --num-gpus N --seed S` (calibration 128 x 512 "
             "tokens), scored together by `quantkit eval` on the held-out text (16,384 tokens).", "",
             "| method | run | rc | wall | quantize step | KLD | top-1 | ppl ratio |", "|---|---|---|---|---|---|---|---|"]
    for method, block in data["methods"].items():
        for r in block["runs"]:
            label = next(lab for lab, g, s in RUNS if (g, s) == (r["gpus"], r["seed"]))
            q = f"{r['quantize_s']:.1f}s" if r.get("quantize_s") is not None else "-"
            kld = f"{r['kld']:.5f}" if r.get("kld") is not None else f"`{r.get('error', '-')}`"
            top1 = f"{r['top1']:.4f}" if r.get("top1") is not None else "-"
            ratio = f"{r['ppl_ratio']:.4f}" if r.get("ppl_ratio") is not None else "-"
            lines.append(f"| {method} | {label} | {r['rc']} | {r['wall_s']:.1f}s | {q} | {kld} | {top1} | {ratio} |")
    lines += ["", "| method | KLD 2 GPUs - 1 GPU | seed-to-seed noise (1 GPU) | bound | agree |", "|---|---|---|---|---|"]
    for method, block in data["methods"].items():
        v = block["verdict"]
        if "kld_diff" not in v:
            lines.append(f"| {method} | - | - | - | no: {v['why']} |")
            continue
        lines.append(f"| {method} | {v['kld_diff']:.5f} | {v['seed_noise']:.5f} | {v['bound']:.5f} | "
                     f"{'yes' if v['ok'] else '**no**'} |")
    lines += ["", f"Bound = max(seed-to-seed noise, {FLOOR:.0%} of the one-GPU KLD). Wall times here are dominated by "
              "start-up (a 6.6M-parameter model); the 8B-shape timings are in quantize_cost_8b_x2.md.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["gptq", "awq"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-ddp"))
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS)
    ap.add_argument("--name", default="ddp_agreement")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {**meta.header(), "methods": {}}
    ok = True
    for method in args.methods:
        rows = []
        for label, gpus, seed in RUNS:
            print(f"== {method}: {label}", flush=True)
            rows.append(make(method, gpus, seed, args.workdir / f"{method}-x{gpus}-s{seed}"))
        made = [r for r in rows if r["rc"] == 0]
        if made:
            proc, _ = quantkit("eval", *[r["path"] for r in made], "--baseline", str(TINY),
                               "--report-dir", str(args.workdir / f"{method}-eval"), "--json")
            try:
                results = {Path(x["path"]).name: x for x in json.loads(proc.stdout)["results"]}
            except (json.JSONDecodeError, KeyError):
                results = {}
                for r in made:
                    r["error"] = "eval: " + ((proc.stderr.strip().splitlines() or ["?"])[-1][:300])
            for r in made:
                x = results.get(Path(r["path"]).name) or {}
                r.update({k: x.get(k) for k in ("kld", "top1", "ppl_ratio", "ppl")})
        block = {"runs": rows, "verdict": verdict(rows)}
        ok &= block["verdict"]["ok"]
        data["methods"][method] = block
        meta.write(args.name, data, markdown(data), args.results_dir)
    print(markdown(data))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
