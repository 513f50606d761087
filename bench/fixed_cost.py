"""quantkit's fixed cost per run: the same job through the ``quantkit`` CLI and through llm-compressor's ``oneshot``
called directly by a plain script, on the 135M model, medians of N runs each (issue 44: at most 3 s of quantkit's
own on the 135M model).

    python bench/fixed_cost.py --runs 3 --label after          # appends to bench/results/fixed_cost.json, writes .md
    python bench/fixed_cost.py direct fp8 OUT                  # one run of the plain script (what the bench times)

Jobs: ``fp8`` (FP8_DYNAMIC, no calibration), ``gptq`` (W4A16 GPTQ, 16 samples of 256 tokens of the shipped
``mixed`` set through the model's chat template, as quantkit's default ``auto`` does for an instruct model). Each
run is a fresh process; wall seconds and CPU seconds (user + system of the process and its children) are measured
from outside, as the difference quantkit − direct is what quantkit adds: its imports, checks, calibration set,
manifest, sealing. The token cache (quantkit.token_cache) lives in a folder of the bench's own (QUANTKIT_CACHE_DIR),
emptied before the first quantkit run: the first calibrated run tokenizes, the later ones reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "real" / "SmolLM2-135M-Instruct"
RESULTS = ROOT / "bench" / "results"
SAMPLES, SEQ_LEN = 16, 256
QUANTKIT = {"fp8": ["fp8", "--scheme", "dynamic"],
            "gptq": ["gptq", "--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN)]}


def direct(job: str, out: str) -> None:
    """The job as a user of llm-compressor writes it: load, oneshot, save (no checks, no manifest)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype="auto")
    torch.manual_seed(0)
    if job == "fp8":
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]),
                processor=tok)
    else:
        from datasets import Dataset

        sys.path.insert(0, str(ROOT))
        from quantkit.calibration import load_documents

        docs = load_documents("mixed").items[:SAMPLES]
        ids = [tok(tok.apply_chat_template([{"role": "user", "content": ""}, {"role": "assistant", "content": d}],
                                           tokenize=False), add_special_tokens=False)["input_ids"][:SEQ_LEN]
               for d in docs]
        # W4A16 in groups of 64, as quantkit chooses for this model (576 columns: 128 does not divide them)
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
        oneshot(model=model, recipe=GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                                 ignore=["lm_head"]),
                dataset=Dataset.from_dict({"input_ids": ids}), num_calibration_samples=SAMPLES,
                max_seq_length=SEQ_LEN, processor=tok)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one process and its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(runs: int, label: str, jobs: list[str]) -> dict:
    env = {**os.environ, "QUANTKIT_CACHE_DIR": tempfile.mkdtemp(prefix="quantkit-bench-cache-"),
           "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="quantkit-fixed-cost-") as tmp:
        for job in jobs:
            times: dict[str, list[tuple[float, float]]] = {"quantkit": [], "direct": []}
            loads = [_load()]
            for i in range(runs):  # alternated, so a drift of the machine's load falls on both
                out = Path(tmp) / f"{job}-{i}"
                times["quantkit"].append(_timed([sys.executable, "-m", "quantkit", *QUANTKIT[job], str(MODEL),
                                                 str(out / "q"), "--quiet"], env))
                manifest = json.loads((out / "q" / "quantkit.json").read_text())
                times["direct"].append(_timed([sys.executable, __file__, "direct", job, str(out / "d")], env))
                loads.append(_load())
                shutil.rmtree(out)
            med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                   for k, v in times.items()}
            rows.append({"job": job, "runs": runs, "load_average": loads,
                         "quantkit": {"wall_s": [round(w, 1) for w, _ in times["quantkit"]],
                                      "cpu_s": [round(c, 1) for _, c in times["quantkit"]]},
                         "direct": {"wall_s": [round(w, 1) for w, _ in times["direct"]],
                                    "cpu_s": [round(c, 1) for _, c in times["direct"]]},
                         "median_wall_s": {k: round(v[0], 1) for k, v in med.items()},
                         "median_cpu_s": {k: round(v[1], 1) for k, v in med.items()},
                         "quantkit_own_wall_s": round(med["quantkit"][0] - med["direct"][0], 1),
                         "quantkit_own_cpu_s": round(med["quantkit"][1] - med["direct"][1], 1),
                         "last_timings": manifest.get("timings"),
                         "last_calibration_reused": (manifest.get("calibration") or {}).get("tokens_reused")})
    return {"label": label, "when": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other sessions (load average "
                       "given per run)",
            "command": f"python bench/fixed_cost.py --runs {runs} --label {label!r} --jobs {' '.join(jobs)}",
            "model": MODEL.name, "rows": rows}


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def markdown(results: list[dict]) -> str:
    lines = ["# quantkit's fixed cost per run (bench/fixed_cost.py)", "",
             "The same job through `quantkit` and through llm-compressor's `oneshot` in a plain script (load, oneshot, "
             "save), fresh processes, alternated; medians. CPU = user + system of the process and its children, "
             "steadier than wall time on a shared machine. quantkit's own = quantkit − direct.", ""]
    for res in results:
        lines += [f"## {res['label']} ({res['when']}, commit {res['commit']})", "",
                  f"`{res['command']}`; {res['machine']}; model {res['model']}.", "",
                  "| job | runs | quantkit wall | direct wall | quantkit's own wall | quantkit CPU | direct CPU | "
                  "quantkit's own CPU | load average |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["rows"]:
            mw, mc = r["median_wall_s"], r["median_cpu_s"]
            lines.append(f"| {r['job']} | {r['runs']} | {mw['quantkit']} s | {mw['direct']} s | "
                         f"{r['quantkit_own_wall_s']} s | {mc['quantkit']} s | {mc['direct']} s | "
                         f"{r['quantkit_own_cpu_s']} s | {', '.join(r['load_average'])} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "direct":
        direct(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", default="now")
    ap.add_argument("--jobs", nargs="+", choices=list(QUANTKIT), default=list(QUANTKIT))
    args = ap.parse_args()
    res = measure(args.runs, args.label, args.jobs)
    path = RESULTS / "fixed_cost.json"
    results = json.loads(path.read_text()) if path.exists() else []
    results = [r for r in results if r["label"] != args.label] + [res]
    path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "fixed_cost.md").write_text(markdown(results))
    print(markdown([res]))


if __name__ == "__main__":
    main()
