"""Task recovery beside KLD: does lm-eval task accuracy order quantized artifacts as KL divergence does?

    python bench/task_recovery.py --engine vllm --out h200/tasks ART1 ART2 ...     # on a GPU machine
    python bench/task_recovery.py --engine transformers --limit 8 --out cpu_smoke/tasks ART  # the script's smoke

Each artifact is scored by ``quantkit eval --tasks`` (the shipped tasks by default) in ``--engine`` (vLLM's Python
found as quantkit finds it: ``--python``, ``$QUANTKIT_VLLM_PYTHON``, its venv, ``vllm`` on PATH); a GGUF artifact is
scored by llama-server on the generation task only (llama-server refuses the echo loglikelihood tasks need). Its KLD
is read from its manifest (the last ``quantkit eval``), else measured now by ``quantkit eval`` in the same engine.
Writes ``bench/results/<out>/task_recovery.{json,md}``: per artifact, each task's recovery and their mean beside its
KLD, and whether ordering the artifacts by mean recovery (best first) gives the order by KLD (lowest first), with
Kendall's tau between the two.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import meta  # noqa: E402

TASKS = ("quantkit_lastword", "quantkit_nextsentence", "quantkit_lastword_gen")
GENERATION = ("quantkit_lastword_gen",)


def _quantkit(*args: str) -> dict[str, Any]:
    """Run ``quantkit ARGS --json``; exit 3 (a gate) still has its JSON document on stdout."""
    proc = subprocess.run([sys.executable, "-m", "quantkit", *args, "--json"], capture_output=True, text=True,
                          cwd=meta.ROOT)
    if proc.returncode not in (0, 3):
        raise SystemExit(f"quantkit {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or any(path.glob("*.gguf"))


def _kld(path: Path, engine: str, python: list[str], max_tokens: int) -> tuple[float | None, str]:
    """The artifact's KLD: its manifest's, else measured now (the same engine), and where it came from."""
    folder = path if path.is_dir() else path.parent
    ev = json.loads((folder / "quantkit.json").read_text()).get("evaluation") or {}
    rows = ev.get("results") or []
    if rows and rows[0].get("kld") is not None:
        return rows[0]["kld"], "manifest"
    with tempfile.TemporaryDirectory() as tmp:
        out = _quantkit("eval", str(path), "--engine", engine, "--max-tokens", str(max_tokens), "--report-dir", tmp,
                        *python)
    return out["results"][0]["kld"], f"measured ({max_tokens} tokens)"


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a between two scorings of the same items (1: same order, -1: reversed)."""
    n = len(a)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if not pairs:
        return None
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
            for i, j in pairs)
    return s / len(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", type=Path, help="artifact folders made from one source")
    ap.add_argument("--engine", default="vllm", help="vllm (GPU), sglang, or transformers (the CPU smoke)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (shipped by default)")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: every item)")
    ap.add_argument("--max-tokens", type=int, default=32768, help="KLD tokens when a manifest has none")
    ap.add_argument("--python", default=None, help="the engine's Python (else quantkit's rule: envs.py)")
    ap.add_argument("--out", required=True, help="folder under bench/results (e.g. h200/tasks)")
    args = ap.parse_args(argv)
    python = ["--python", args.python] if args.python else []
    limit = ["--limit", str(args.limit)] if args.limit else []
    tasks = [t for t in args.tasks.split(",") if t]
    rows = []
    for art in args.artifacts:
        gguf = _is_gguf(art)
        engine = "llama.cpp" if gguf else args.engine
        mine = [t for t in tasks if t in GENERATION] if gguf else tasks
        with tempfile.TemporaryDirectory() as tmp:
            report = _quantkit("eval", str(art), "--engine", engine, "--tasks", ",".join(mine), *limit,
                               "--report-dir", tmp, *python)
        rec = {f"{r['task']} {r['metric']}": r["recovery"] for r in report["rows"]}
        kld, where = _kld(art, engine, python, args.max_tokens)
        known = [v for v in rec.values() if v is not None]
        rows.append({"artifact": art.name, "engine": engine, "kld": kld, "kld_from": where, "recovery": rec,
                     "mean_recovery": sum(known) / len(known) if known else None,
                     "scores": report["rows"], "baseline_cached": any(b["cached"]
                                                                      for b in report["baselines"].values())})
    ranked = [r for r in rows if r["kld"] is not None and r["mean_recovery"] is not None]
    by_kld = [r["artifact"] for r in sorted(ranked, key=lambda r: r["kld"])]
    by_task = [r["artifact"] for r in sorted(ranked, key=lambda r: -r["mean_recovery"])]
    tau = kendall_tau([-r["kld"] for r in ranked], [r["mean_recovery"] for r in ranked])
    data = {**meta.header(), "engine": args.engine, "tasks": tasks, "limit": args.limit, "rows": rows,
            "order_by_kld": by_kld, "order_by_task_recovery": by_task, "same_order": by_kld == by_task,
            "kendall_tau": tau}
    cols = sorted({k for r in rows for k in r["recovery"]})
    md = ["# Task recovery beside KLD", "", meta.md_header(data),
          "| artifact | engine | KLD | " + " | ".join(cols) + " | mean recovery |",
          "|" + "---|" * (len(cols) + 4)]
    for r in rows:
        cells = ["-" if r["recovery"].get(c) is None else f"{r['recovery'][c]:.4f}" for c in cols]
        kld = "-" if r["kld"] is None else f"{r['kld']:.4f}"
        mean = "-" if r["mean_recovery"] is None else f"{r['mean_recovery']:.4f}"
        md.append(f"| {r['artifact']} | {r['engine']} | {kld} | " + " | ".join(cells) + f" | {mean} |")
    md += ["", f"Order by KLD (lowest first): {', '.join(by_kld)}.",
           f"Order by mean task recovery (highest first): {', '.join(by_task)}.",
           f"Same order: {'yes' if data['same_order'] else 'no'}; Kendall's tau "
           f"{'-' if tau is None else f'{tau:.3f}'} (1 = same order). recovery = artifact / baseline per task and "
           f"metric; items per task: {args.limit or 'all'}; a GGUF artifact is scored on the generation task only.",
           ""]
    j, m = meta.write("task_recovery", data, "\n".join(md), meta.RESULTS / args.out)
    print(f"wrote {j} and {m}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
