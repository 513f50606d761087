"""Merge the FP4 CPU sweep's eval results (eval*.json, each one `quantkit eval` on the same tokens) with each
artifact's manifest (how it was made, how long it took) into fp4_cpu.json, and print the README's table.

    python bench/results/fp4_cpu/summarize.py [WORK]    # WORK: where run.sh left the artifacts
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/quantkit/bench/fp4_cpu"


def main() -> None:
    rows, protocol, baseline = [], None, None
    for f in sorted(HERE.glob("eval*.json")):
        data = json.loads(f.read_text())
        if protocol not in (None, data["protocol"]):
            raise SystemExit(f"{f.name} scored other tokens than the first file")
        protocol, baseline = data["protocol"], data["baseline"]
        for r in data["results"]:
            m = json.loads((WORK / r["label"] / "quantkit.json").read_text())
            q = m["quantization"]
            rows.append({"artifact": r["label"], "method": m["method"], "algorithm": q["algorithm"],
                         "observer": q["observer"], "kld": r["kld"], "top1": r["top1"], "ppl": r["ppl"],
                         "ppl_ratio": r["ppl_ratio"], "bits_per_weight": r["bits_per_weight"],
                         "calibration": m["calibration"] and {k: m["calibration"][k] for k in ("samples", "seq_len",
                                                                                                "tokens")},
                         "quantize_s": m["timings"]["total"]})
    rows.sort(key=lambda r: (r["method"], r["kld"]))
    (HERE / "fp4_cpu.json").write_text(json.dumps({"protocol": protocol, "baseline": baseline, "rows": rows},
                                                  indent=1) + "\n")
    print("| format | algorithm | observer | KLD | top-1 | ppl ratio | bits/weight (file) | quantize time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['algorithm']} | {r['observer'].removeprefix('memoryless_')} | {r['kld']:.4f} | "
              f"{r['top1']:.4f} | {r['ppl_ratio']:.4f} | {r['bits_per_weight']:.2f} | {r['quantize_s']:.0f} s |")


if __name__ == "__main__":
    main()
