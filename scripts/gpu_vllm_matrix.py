#!/usr/bin/env python3
"""Load each artifact in vLLM's offline engine and record: loads?, the quantization method and linear kernel vLLM
picked, and greedy decode tokens/s at batch 1 and 16.

A cheaper companion to ``scripts/gpu_smoke.py`` (which starts a real ``vllm serve`` per artifact, about two
minutes each): one short subprocess per artifact (imports + load + generate, ~30 s with ``enforce_eager``), so
every format fits in one device call. Run on the GPU machine from the repository root, vLLM installed in
/tmp/site (../shared/device/vllm/README.md):

    python3 scripts/gpu_vllm_matrix.py ART [ART ...] --out "$OUT"

Writes OUT/vllm_matrix.json and OUT/vllm_matrix.md, rewritten after every artifact, and each child's log in
OUT/vllm_logs/NAME.log. Standard library only in this parent process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
art = sys.argv[1]
llm = LLM(model=art, enforce_eager=True, max_model_len=1024, gpu_memory_utilization=0.25, seed=0)
cfg = llm.llm_engine.model_config
sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
prompt = "def parse_args(argv):\n    "
out = {"quantization": cfg.quantization, "dtype": str(cfg.dtype)}
llm.generate([prompt], sp)  # warm-up
for batch in (1, 16):
    t = time.perf_counter()
    res = llm.generate([prompt] * batch, sp)
    dt = time.perf_counter() - t
    out[f"tok_s_b{batch}"] = round(sum(len(r.outputs[0].token_ids) for r in res) / dt, 1)
out["sample"] = res[0].outputs[0].text[:80]
print("RESULT " + json.dumps(out), flush=True)
"""

KERNEL_RE = re.compile(r"(Using|Selected) ([A-Za-z0-9_]+) for ([A-Za-z0-9_]+)|([A-Za-z0-9_]*Kernel[A-Za-z0-9_]*)")


def kernels_in(log: str) -> list[str]:
    """The linear-layer kernels vLLM names in its log ("Using MacheteLinearKernel for CompressedTensorsWNA16")."""
    kernels = sorted({" ".join(m.group(0).split()) for m in KERNEL_RE.finditer(log)
                      if ("for " in m.group(0)) or m.group(4)} - {"Kernel"})
    return [k for k in kernels if "Kernel" in k][:4]


def run_child(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[str, int, dict | None]:
    """Run a vLLM child script: its whole output (kept in ``log``), exit code (-1 on timeout) and the JSON it
    printed on its ``RESULT`` line, if it got that far."""
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), -1
    log.write_text(text)
    results = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
    return text, rc, (results[-1] if results else None)


def run_one(art: Path, out: Path, site: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": site, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    log = out / "vllm_logs" / f"{art.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    text, rc, result = run_child([sys.executable, "-c", CHILD, str(art)], env, timeout, log)
    row: dict = {"artifact": art.name, "seconds": round(time.perf_counter() - t, 1), "loads": result is not None}
    row.update(result or {})
    row["kernels"] = kernels_in(text)
    fmt = art / "config.json"
    if fmt.exists():
        q = json.loads(fmt.read_text()).get("quantization_config") or {}
        row["format"] = q.get("format") or q.get("quant_method") or "-"
    if not row["loads"]:
        errs = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        row["error"] = (errs[-1] if errs else text.strip().splitlines()[-1:] or ["?"])[-1][:300]
        row["returncode"] = rc
    return row


def write(out: Path, rows: list[dict]) -> None:
    (out / "vllm_matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| artifact | format | loads | vLLM quantization | kernel | tok/s b1 | tok/s b16 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['artifact']} | {r.get('format', '-')} | {'yes' if r['loads'] else 'NO: ' + r.get('error', '')} "
                     f"| {r.get('quantization', '-')} | {'; '.join(r.get('kernels', [])) or '-'} "
                     f"| {r.get('tok_s_b1', '-')} | {r.get('tok_s_b16', '-')} |")
    (out / "vllm_matrix.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "vllm_matrix_out")))
    ap.add_argument("--site", default="/tmp/site")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--budget", type=float, default=500, help="stop starting new artifacts after this many seconds")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    start = time.perf_counter()
    for art in args.artifacts:
        if time.perf_counter() - start > args.budget:
            rows.append({"artifact": art.name, "loads": False, "error": "not run (time budget)"})
            continue
        rows.append(run_one(art, args.out, args.site, args.timeout))
        write(args.out, rows)
        print(json.dumps(rows[-1]), flush=True)
    write(args.out, rows)


if __name__ == "__main__":
    main()
