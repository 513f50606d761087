"""Bits per weight of an FP4 (NVFP4 or MXFP4) compressed-tensors artifact's quantized layers, counted from its files:
the packed E2M1 values, the group scales and the global scales, over the weights they encode; and the bits frontier's
NVFP4 mixes (``--target-bits``) made and scored on this machine.

    python bench/fp4_bits.py ARTIFACT... > artifacts.json
    python bench/fp4_bits.py mixes WORK [TARGET...]     # NVFP4 mixes on SmolLM2-135M-Instruct into WORK, scored
                                                        # against plain NVFP4 on the same tokens; writes
                                                        # bench/results/fp4_bits_cpu/frontier.{json,md}

``mixes`` makes, with the ``nvfp4`` verb (round-to-nearest, min-max: what a shared 2-core CPU affords; the H200
frontier's points are GPTQ), plain NVFP4 and a mix at each target (default 5.0, 5.5, 6.0) with each ``--high`` (int8
and fp8), all on one small calibration (``SAMPLES`` x ``SEQ_LEN``, default 4 x 256) so the layer groups' sensitivity
is measured once and read from quantkit's cache by every later mix; then one ``quantkit eval --engine transformers``
scores them all, exactly, on the same ``TOKENS`` (default 4,096) held-out tokens. An artifact already in WORK is
reused.

Reads tensor shapes and dtypes from the safetensors headers only (no weights are loaded). The layout fixes the result
(NVFP4: 4 + 8/16 bits, plus one FP32 global scale per tensor; MXFP4: 4 + 8/32), so an artifact made anywhere with
the same shapes counts the same: bench/results/h200/fp4/artifacts.json was counted on artifacts the CPU made.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

from quantkit.source import DTYPE_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

MODEL = "models/real/SmolLM2-135M-Instruct"
TARGETS = ("5.0", "5.5", "6.0")
HIGHS = ("int8", "fp8")
OUT = meta.RESULTS / "fp4_bits_cpu"
PARTS = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")


def count(folder: Path) -> dict[str, float | int]:
    """The quantized layers' bits per weight and how many weights they hold."""
    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                shapes[k] = sl.get_shape()
                sizes[k] = DTYPE_BYTES[sl.get_dtype()] * math.prod(shapes[k])
    bits = weights = 0
    for name in (k for k in shapes if k.endswith(".weight_packed")):
        module = name.removesuffix(".weight_packed")
        rows, cols = shapes[name]
        weights += rows * cols * 2  # two E2M1 values a byte
        bits += 8 * sum(sizes.get(module + part, 0) for part in PARTS)
    if not weights:
        raise SystemExit(f"{folder}: no FP4 weight_packed tensor")
    return {"measured_bits": round(bits / weights, 4), "quantized_weights": weights}


def _quantkit(*args: str) -> str:
    """Run the quantkit CLI from this checkout; its JSON document."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "OMP_WAIT_POLICY": "PASSIVE",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "quantkit", *args, "--json"], cwd=meta.ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"quantkit {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def mixes(work: Path, targets: tuple[str, ...]) -> None:
    """Make plain NVFP4 and its mixes (the module docstring), score them on the same tokens, write the table."""
    calib = ["--samples", os.environ.get("SAMPLES", "4"), "--seq-len", os.environ.get("SEQ_LEN", "256")]
    tokens = os.environ.get("TOKENS", "4096")
    made = {"nvfp4-rtn": ["--algorithm", "rtn", "--observer", "minmax"]}
    made |= {f"nvfp4-rtn-b{t}-{h}": ["--algorithm", "rtn", "--target-bits", t, "--high", h, *calib]
             for t in targets for h in HIGHS}
    for name, flags in made.items():
        if not (work / name / "quantkit.json").exists():
            print(f"making {name}", file=sys.stderr)
            _quantkit("nvfp4", MODEL, str(work / name), *flags, "--force")
    scores = json.loads(_quantkit("eval", *(str(work / n) for n in made), "--engine", "transformers", "--baseline",
                                  MODEL, "--dataset", "heldout", "--max-tokens", tokens, "--ctx", "2048", "--device",
                                  "cpu", "--max-ppl-ratio", "100", "--max-kld", "100", "--min-top1", "0"))["results"]
    rows: list[dict[str, Any]] = []
    for name, r in zip(made, scores):
        m = json.loads((work / name / "quantkit.json").read_text())
        mix = m["quantization"].get("mixed") or {}
        rows.append({"artifact": name, "bits": mix.get("measured_bits", count(work / name)["measured_bits"]),
                     "high": m["quantization"].get("high"), "units_at_high": mix.get("units_at_high"),
                     "kld": r["kld"], "top1": r["top1"], "ppl_ratio": r["ppl_ratio"],
                     "sensitivity": (mix.get("sensitivity") or {}).get("cache"),
                     "quantize_s": m.get("timings", {}).get("total")})
    header = meta.header()
    md = (f"# NVFP4 with --target-bits on the CPU: SmolLM2-135M-Instruct\n\n{meta.md_header(header)}"
          f"- made: round-to-nearest (min-max), calibration {calib[1]} x {calib[3]} tokens (the sensitivity pass's); "
          f"scored: exact KLD against the bf16 model, transformers on this CPU, {int(tokens):,} held-out tokens\n\n"
          "| artifact | bits/weight | 8-bit layers | groups at 8 bits | KLD | top-1 | ppl ratio | sensitivity |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |\n")
    md += "".join(f"| {r['artifact']} | {r['bits']:.3f} | {r['high'] or '-'} | {r['units_at_high'] or '-'} | "
                  f"{r['kld']:.4f} | {r['top1']:.3f} | {r['ppl_ratio']:.3f} | {r['sensitivity'] or '-'} |\n"
                  for r in sorted(rows, key=lambda r: r["bits"]))
    print(md)
    meta.write("frontier", {**header, "tokens": int(tokens), "calibration": calib, "rows": rows}, md, OUT)


def main() -> None:
    if sys.argv[1:2] == ["mixes"] and len(sys.argv) >= 3:
        mixes(Path(sys.argv[2]), tuple(sys.argv[3:]) or TARGETS)
    elif sys.argv[1:] and sys.argv[1] != "mixes":
        print(json.dumps({Path(p).name: count(Path(p)) for p in sys.argv[1:]}, indent=1))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
