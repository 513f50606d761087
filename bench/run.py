"""The benchmarks' one entry point (issue 10): ``make bench`` runs ``python bench/run.py all``.

    python bench/run.py quality [--quick]   # every method on the reference model, held-out split (CPU)
    python bench/run.py gguf [--quick]      # HF -> GGUF conversion, quantkit vs llama.cpp (8B shape; quick: small)
    python bench/run.py gguf-imatrix [--quick]  # GGUF with and without an importance matrix, and its cost (CPU)
    python bench/run.py gguf-imatrix-moe [--quick]  # the same on the MoE reference model (per-expert matrices)
    python bench/run.py all [--quick]       # all four
    python bench/run.py index               # only rebuild bench/results/README.md from the result files

Each writes bench/results/NAME.{json,md} with the machine, library versions, date and exact command. The GPU
benchmarks are separate because they need an H200: ``make bench-gpu`` (bench/quantize_cost.py); the vLLM serving
results under bench/results/h200/ came from scripts run on an H200 (bench/results/README.md says which).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def quality(quick: bool) -> None:
    import quality as q

    q.main(["--quick"] if quick else [])


def gguf(quick: bool) -> None:
    """The conversion benchmark is its own script (it writes a checkpoint of the shape first); run it as one,
    then add the provenance block to the entry it wrote (its file holds one entry per shape)."""
    import meta

    shape = "small" if quick else "8b"
    argv = [sys.executable, str(HERE / "gguf_convert.py"), "--shape", shape]
    rc = subprocess.run(argv, cwd=HERE.parent).returncode
    if rc:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {rc}")
    path = meta.RESULTS / "gguf_convert.json"
    results = json.loads(path.read_text())
    results[shape]["provenance"] = {**meta.header(), "inner_command": f"python bench/gguf_convert.py --shape {shape}"}
    path.write_text(json.dumps(results, indent=2) + "\n")


def gguf_imatrix(quick: bool) -> None:
    import gguf_imatrix as gi

    gi.main(["--quick"] if quick else [])


def gguf_imatrix_moe(quick: bool) -> None:
    import gguf_imatrix as gi

    gi.main(["--model", "moe"] + (["--quick"] if quick else []))


BENCHES = {"quality": quality, "gguf": gguf, "gguf-imatrix": gguf_imatrix, "gguf-imatrix-moe": gguf_imatrix_moe}


def index() -> None:
    import index as ix

    print(f"index: {ix.build()}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Run quantkit's benchmarks and write bench/results/.")
    ap.add_argument("which", choices=[*BENCHES, "all", "index"], nargs="?", default="all",
                    help="index only rebuilds bench/results/README.md from the committed results")
    ap.add_argument("--quick", action="store_true", help="small sizes: a check that the benchmarks run, not figures")
    args = ap.parse_args()
    for name in BENCHES if args.which == "all" else [] if args.which == "index" else [args.which]:
        print(f"== {name}", flush=True)
        BENCHES[name](args.quick)
    if not args.quick:  # quick results go to bench/results/quick/ and are not indexed
        index()


if __name__ == "__main__":
    main()
