"""quantkit's fixed cost per run: the same job through the ``quantkit`` CLI and through llm-compressor's ``oneshot``
called directly by a plain script, on the 135M model, medians of N runs each (issue 44: at most 3 s of quantkit's
own on the 135M model).

    python bench/fixed_cost.py --runs 3 --label after          # appends to bench/results/fixed_cost.json, writes .md
    python bench/fixed_cost.py direct fp8 OUT                  # one run of the plain script (what the bench times)

Jobs: ``fp8`` (FP8_DYNAMIC, no calibration), ``gptq`` (W4A16, quantkit's default: the imatrix_mse observer, static
activation order), ``int8`` (SmoothQuant 0.8, then GPTQ W8A8) and ``awq`` (W4A16 asymmetric), the last three
calibrated on 16 samples of 256 tokens of the shipped ``mixed`` set through the model's chat template, as
quantkit's default ``auto`` does for an instruct model. The direct script runs the very recipe quantkit records in
its manifest (``quantization.recipe``; groups of 64, as quantkit chooses for this model's 576 columns) on the very
token ids (its sha256 against the manifest's), and the bench checks both per run (``same_recipe``,
``same_tokens``), so the difference is what quantkit adds, not other work. Each run is a fresh process; wall seconds
and CPU seconds (user + system of the process and its children) are measured from outside, as the difference
quantkit − direct is what quantkit adds: its imports, checks, calibration set, manifest, sealing, and minus what
its exit skips (quantkit.cli.main._leave: the interpreter's teardown, which the direct script pays). The token
cache (quantkit.token_cache) lives in a folder of the bench's own (QUANTKIT_CACHE_DIR), emptied before the first
quantkit run: the first calibrated run tokenizes, the later ones reuse.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "real" / "SmolLM2-135M-Instruct"
RESULTS = ROOT / "bench" / "results"
SAMPLES, SEQ_LEN = 16, 256
CALIBRATED = ["--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN)]
QUANTKIT = {"fp8": ["fp8", "--scheme", "dynamic"], "gptq": ["gptq", *CALIBRATED], "int8": ["int8", *CALIBRATED],
            "awq": ["awq", *CALIBRATED]}
_IGNORE = {"targets": ["Linear"], "ignore": ["lm_head"]}


def _int4(symmetric: bool, **observer: str) -> dict[str, Any]:
    """One config group of int4 weights in groups of 64, as quantkit's recipe for this model spells it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False, "strategy": "group",
               "group_size": 64, **observer}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


# Each job's llm-compressor recipe, as quantkit's manifest records it (quantization.recipe): the direct script runs it.
RECIPES: dict[str, list[dict[str, dict[str, Any]]]] = {
    "fp8": [{"QuantizationModifier": {"scheme": "FP8_DYNAMIC", **_IGNORE}}],
    "gptq": [{"GPTQModifier": {**_int4(True, observer="imatrix_mse"), "dampening_frac": 0.01, "actorder": "static",
                               **_IGNORE}}],
    "int8": [{"SmoothQuantModifier": {"smoothing_strength": 0.8}}, {"GPTQModifier": {"scheme": "W8A8", **_IGNORE}}],
    "awq": [{"AWQModifier": {"duo_scaling": True, "offload_device": None}},
            {"QuantizationModifier": {**_int4(False), **_IGNORE}}],
}
MODULES = {"QuantizationModifier": "llmcompressor.modifiers.quantization",
           "GPTQModifier": "llmcompressor.modifiers.gptq", "SmoothQuantModifier": "llmcompressor.modifiers.transform",
           "AWQModifier": "llmcompressor.modifiers.transform"}


def _token_ids(tok: Any) -> list[list[int]]:
    """quantkit's calibration samples for this spec (quantkit.calibration: the shipped documents, shuffled with seed
    0, each the assistant's reply to an empty user turn, truncated), made here without importing quantkit."""
    import gzip
    import random

    docs: list[str] = []
    for name in ("prose", "code"):
        with gzip.open(ROOT / "calibration" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs += [t for line in f if line.strip() and (t := json.loads(line)["text"])]
    order = list(range(len(docs)))
    random.Random(0).shuffle(order)
    chats = [tok.apply_chat_template([{"role": "user", "content": ""}, {"role": "assistant", "content": docs[i]}],
                                     tokenize=False) for i in order[:SAMPLES]]
    return [tok(c, add_special_tokens=False)["input_ids"][:SEQ_LEN] for c in chats]


def direct(job: str, out: str) -> None:
    """The job as a user of llm-compressor writes it: load, oneshot with the recipe, save (no checks, no manifest).
    Prints the sha256 of its calibration tokens (quantkit.calibration.tokens_sha256's layout) on stdout, and at the
    end the time and its CPU seconds so far (``work_done: TIME CPU``): what it cost before the interpreter's
    teardown, which quantkit's exit skips."""
    import hashlib
    import importlib

    import numpy as np
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype="auto")
    torch.manual_seed(0)
    recipe = [getattr(importlib.import_module(MODULES[name]), name)(**kwargs)
              for step in RECIPES[job] for name, kwargs in step.items()]
    data: dict[str, Any] = {}
    if job != "fp8":
        from datasets import Dataset

        ids = _token_ids(tok)
        h = hashlib.sha256()
        for s in ids:
            h.update(len(s).to_bytes(4, "little") + np.asarray(s, dtype="<i4").tobytes())
        print(f"tokens_sha256: {h.hexdigest()}", flush=True)
        data = {"dataset": Dataset.from_dict({"input_ids": ids}), "num_calibration_samples": SAMPLES,
                "max_seq_length": SEQ_LEN, "shuffle_calibration_samples": False}
    if job == "awq" and not torch.accelerator.is_available():
        # llm-compressor 0.14.0.1's AWQ pins its cached activations, which torch refuses without an accelerator: the
        # same skip quantkit makes (quantkit.producers.patches.awq_without_pin_memory), or AWQ cannot run on a CPU
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    oneshot(model=model, recipe=recipe, processor=tok, **data)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    used = resource.getrusage(resource.RUSAGE_SELF)
    print(f"work_done: {time.time()} {used.ru_utime + used.ru_stime}", flush=True)


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str, float]:
    """(wall, CPU) seconds of one process and its children, its stdout, and when it started (epoch seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout, started


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(runs: int, label: str, jobs: list[str], note: str) -> dict:
    env = {**os.environ, "QUANTKIT_CACHE_DIR": tempfile.mkdtemp(prefix="quantkit-bench-cache-"),
           "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="quantkit-fixed-cost-") as tmp:
        for job in jobs:
            times: dict[str, list[tuple[float, float]]] = {"quantkit": [], "direct": [], "direct_work": []}
            loads, same_recipe, same_tokens = [_load()], [], []
            for i in range(runs):  # alternated, so a drift of the machine's load falls on both
                out = Path(tmp) / f"{job}-{i}"
                wall, cpu, _, _ = _timed([sys.executable, "-m", "quantkit", *QUANTKIT[job], str(MODEL),
                                          str(out / "q"), "--quiet"], env)
                times["quantkit"].append((wall, cpu))
                manifest = json.loads((out / "q" / "quantkit.json").read_text())
                wall, cpu, stdout, started = _timed([sys.executable, __file__, "direct", job, str(out / "d")], env)
                times["direct"].append((wall, cpu))
                said = dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)
                done, work_cpu = map(float, said["work_done"].split())
                times["direct_work"].append((done - started, work_cpu))
                loads.append(_load())
                same_recipe.append(manifest["quantization"]["recipe"] == RECIPES[job])
                recorded = (manifest.get("calibration") or {}).get("tokens_sha256")
                same_tokens.append(said.get("tokens_sha256") == recorded)
                shutil.rmtree(out)
            med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                   for k, v in times.items()}
            rows.append({"job": job, "runs": runs, "load_average": loads,
                         "quantkit": {"wall_s": [round(w, 1) for w, _ in times["quantkit"]],
                                      "cpu_s": [round(c, 1) for _, c in times["quantkit"]]},
                         "direct": {"wall_s": [round(w, 1) for w, _ in times["direct"]],
                                    "cpu_s": [round(c, 1) for _, c in times["direct"]]},
                         "direct_before_teardown": {"wall_s": [round(w, 1) for w, _ in times["direct_work"]],
                                                    "cpu_s": [round(c, 1) for _, c in times["direct_work"]]},
                         "median_wall_s": {k: round(v[0], 1) for k, v in med.items()},
                         "median_cpu_s": {k: round(v[1], 1) for k, v in med.items()},
                         "quantkit_own_wall_s": round(med["quantkit"][0] - med["direct"][0], 1),
                         "quantkit_own_cpu_s": round(med["quantkit"][1] - med["direct"][1], 1),
                         "quantkit_own_cpu_s_teardown_aside": round(med["quantkit"][1] - med["direct_work"][1], 1),
                         "same_recipe": all(same_recipe), "same_tokens": all(same_tokens),
                         "last_timings": manifest.get("timings"),
                         "last_calibration_reused": (manifest.get("calibration") or {}).get("tokens_reused")})
    return {"label": label, "when": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other sessions (load average "
                       "given per run)",
            "command": f"python bench/fixed_cost.py --runs {runs} --label {label!r} --jobs {' '.join(jobs)}"
                       + (" --note ..." if note else ""),
            "model": MODEL.name, "note": note, "rows": rows}


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def markdown(results: list[dict]) -> str:
    lines = ["# quantkit's fixed cost per run (bench/fixed_cost.py)", "",
             "The same job through `quantkit` and through llm-compressor's `oneshot` in a plain script (load, oneshot, "
             "save), fresh processes, alternated; medians. CPU = user + system of the process and its children, "
             "steadier than wall time on a shared machine. quantkit's own = quantkit − direct. Same recipe / same "
             "tokens: whether the direct script ran the recipe quantkit's manifest records, on the token ids it "
             "records, in every run (- where the section predates the check). Teardown aside: quantkit's CPU against "
             "the direct script's before its interpreter's teardown (which quantkit's exit skips, "
             "quantkit.cli.main._leave), so what quantkit's own work costs whatever the way out (- where the section "
             "predates it).", ""]
    for res in results:
        lines += [f"## {res['label']} ({res['when']}, commit {res['commit']})", "",
                  f"`{res['command']}`; {res['machine']}; model {res['model']}.", ""]
        if res.get("note"):
            lines += [res["note"], ""]
        lines += ["| job | runs | quantkit wall | direct wall | quantkit's own wall | quantkit CPU | direct CPU | "
                  "quantkit's own CPU | direct CPU before teardown | quantkit's own CPU, teardown aside | "
                  "same recipe / tokens | load average |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["rows"]:
            mw, mc = r["median_wall_s"], r["median_cpu_s"]
            same = "-" if "same_recipe" not in r else \
                f"{'yes' if r['same_recipe'] else 'NO'} / {'yes' if r['same_tokens'] else 'NO'}"
            work = f"{mc['direct_work']} s" if "direct_work" in mc else "-"
            aside = f"{r['quantkit_own_cpu_s_teardown_aside']} s" if "direct_work" in mc else "-"
            lines.append(f"| {r['job']} | {r['runs']} | {mw['quantkit']} s | {mw['direct']} s | "
                         f"{r['quantkit_own_wall_s']} s | {mc['quantkit']} s | {mc['direct']} s | "
                         f"{r['quantkit_own_cpu_s']} s | {work} | {aside} | {same} | {', '.join(r['load_average'])} |")
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
    ap.add_argument("--note", default="", help="a paragraph shown under the section's heading")
    args = ap.parse_args()
    path = RESULTS / "fixed_cost.json"
    res: dict = {}
    for job in args.jobs:  # written after each job, so a run cut short keeps what it measured
        one = measure(args.runs, args.label, [job], args.note)
        res = {**one, "rows": [*res.get("rows", []), *one["rows"]],
               "command": one["command"].replace(f"--jobs {job}", f"--jobs {' '.join(args.jobs)}")}
        results = json.loads(path.read_text()) if path.exists() else []
        results = [r for r in results if r["label"] != args.label] + [res]
        path.write_text(json.dumps(results, indent=2) + "\n")
        (RESULTS / "fixed_cost.md").write_text(markdown(results))
    print(markdown([res]))


if __name__ == "__main__":
    main()
