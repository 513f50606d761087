#!/usr/bin/env python3
"""Serve compressed-tensors (and legacy AWQ/GPTQ) artifacts in vLLM with ``quantkit smoke`` on a GPU machine,
and tabulate format x loads x kernel vLLM picked x tokens/s (issue 5's README table).

Run it from the repository root on the lent H200, in ONE device call, once vLLM 0.26.0 is installed into
/tmp/site (../shared/device/vllm/README.md) and llm-compressor's wheels into /tmp/site-llmc:

    python3 scripts/gpu_smoke.py ART [ART ...] [--out "$OUT"]

Each ART is an artifact folder, or a folder of artifact folders. Per artifact it runs the real CLI:

    PYTHONPATH=REPO:/tmp/site-llmc python3 -m quantkit smoke ART --engine vllm --python python3 \
        --env PYTHONPATH=/tmp/site --env VLLM_USE_FLASHINFER_SAMPLER=0 --json --log-dir OUT/logs/NAME

so quantkit (and the compressed-tensors 0.19.0 that wrote the artifacts) runs in one environment and vLLM
(with its compressed-tensors 0.17.0) in another, which is the version skew being tested.

Time: one vLLM start of a small model takes about two minutes (~110 s healthy with --enforce-eager), and a
device call ends at 600 s. Artifacts run in parallel, one per visible GPU (``--per-gpu K`` runs K per GPU with
1/K of the memory each, started ``--stagger`` seconds apart so their memory profiling does not overlap). An
artifact is started only while ``--budget`` leaves at least ``--min-start`` seconds; those not started are listed
as ``not run`` so a second call can take them. When quantkit's doctor refuses an artifact (a version skew it
can see), vLLM is started anyway with ``--skip-doctor``, so the table holds both doctor's prediction and vLLM's
own error (``--no-confirm-refusals`` trusts doctor and saves the two minutes). Results are rewritten after every
artifact, so a call cut short still brings back what finished: ``OUT/gpu_smoke.json``, ``OUT/gpu_smoke.md``,
``OUT/smoke/NAME.json`` (quantkit's own JSON) and ``OUT/logs/NAME/*.log`` (vLLM's logs). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+", type=Path, help="artifact folders, or folders of artifact folders")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_smoke_out")))
    p.add_argument("--python", default="python3", help="the Python that runs vLLM (and quantkit)")
    p.add_argument("--vllm-site", default="/tmp/site", help="PYTHONPATH for vLLM's environment")
    p.add_argument("--quantkit-site", default="/tmp/site-llmc", help="PYTHONPATH added for quantkit's environment")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use [default: all visible]")
    p.add_argument("--per-gpu", type=int, default=1, help="artifacts served at once on each GPU")
    p.add_argument("--stagger", type=float, default=45.0, help="seconds between starts on one GPU (--per-gpu > 1)")
    p.add_argument("--budget", type=float, default=560.0, help="seconds this script may run in all")
    p.add_argument("--min-start", type=float, default=150.0, help="start an artifact only with this much budget left")
    p.add_argument("--timeout", type=float, default=420.0, help="quantkit smoke --timeout (health wait) at most")
    p.add_argument("--baseline", action="store_true", help="also compare greedy tokens with the source model "
                   "(transformers on the GPU; only where the manifest's source exists here)")
    p.add_argument("--no-confirm-refusals", dest="confirm_refusals", action="store_false",
                   help="trust doctor: do not start vLLM for an artifact doctor says it cannot load")
    p.add_argument("--extra", action="append", default=[], help="more arguments for quantkit smoke (repeatable)")
    return p.parse_args()


def expand(paths: list[Path]) -> list[Path]:
    """Artifact folders: those given, or the artifact folders (config.json inside) under a folder given."""
    out: list[Path] = []
    for p in paths:
        if (p / "config.json").exists():
            out.append(p)
        elif p.is_dir():
            out.extend(sorted(c for c in p.iterdir() if (c / "config.json").exists()))
        else:
            print(f"skipping {p}: not an artifact folder", file=sys.stderr)
    return out


def gpu_count() -> int:
    try:
        lines = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        return max(1, sum(1 for ln in lines if ln.startswith("GPU ")))
    except (OSError, subprocess.TimeoutExpired):
        return 1


def preflight(args: argparse.Namespace, qk_env: dict[str, str]) -> None:
    """Fail in seconds, not minutes, when quantkit or vLLM cannot even be imported."""
    qk = subprocess.run([args.python, "-c", "import typer, rich, pydantic, yaml, quantkit.cli.main"],
                        env=qk_env, capture_output=True, text=True)
    if qk.returncode:
        sys.exit(f"quantkit cannot run with {args.python} (PYTHONPATH={qk_env.get('PYTHONPATH')}):\n"
                 f"{qk.stderr[-2000:]}")
    vl = subprocess.run([args.python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                        env={**os.environ, "PYTHONPATH": args.vllm_site}, capture_output=True, text=True)
    if vl.returncode:
        sys.exit(f"vLLM is not importable with PYTHONPATH={args.vllm_site}: install it first "
                 "(../shared/device/vllm/README.md)")


def describe(art: Path) -> dict[str, Any]:
    """Method, format and scheme of an artifact, from its manifest and config (quantkit's own inspect)."""
    from quantkit.inspect import checkpoint_quantization

    info: dict[str, Any] = {}
    try:
        info = checkpoint_quantization(art)
    except Exception as e:  # an unreadable config: the smoke run will say more
        info = {"format": f"unreadable ({e})"}
    try:
        man = json.loads((art / "quantkit.json").read_text())
        info["method"] = man.get("method")
        info["source"] = (man.get("source") or {}).get("path")
        info["params"] = man.get("params")
    except (OSError, json.JSONDecodeError):
        pass
    return info


def name_of(art: Path) -> str:
    return f"{art.parent.name}__{art.name}"


def row(art: Path, info: dict[str, Any], smoke: dict[str, Any] | None, note: str | None) -> dict[str, Any]:
    """One line of the table, from quantkit smoke's JSON."""
    r: dict[str, Any] = {"artifact": f"{art.parent.name}/{art.name}", "path": str(art), "method": info.get("method"),
                         "format": info.get("ct_format") or info.get("format"), "scheme": info.get("scheme"),
                         "strategy": info.get("strategy"), "group_size": info.get("group_size"),
                         "activations": info.get("activations")}
    if smoke is None:
        r.update(loads="not run", error=note)
        return r
    run = (smoke.get("runs") or [{}])[0]
    facts = run.get("facts") or {}
    doc = smoke.get("doctor") or {}
    err = run.get("error") or note
    r.update(
        loads={"passed": "yes", "failed": "NO", "refused": "NO (doctor)"}.get(run.get("status"), run.get("status")),
        vllm=doc.get("engine_version"),
        ct_written=(doc.get("written_with") or {}).get("compressed-tensors"),
        ct_read=(doc.get("read_with") or {}).get("compressed-tensors"),
        doctor=[f"{c['status']}: {c['name']}: {c['message']}" for c in doc.get("checks", []) if c["status"] != "ok"],
        quantization=facts.get("quantization"), kernels=facts.get("kernels"), schemes=facts.get("schemes"),
        attention=facts.get("attention_backend"), ready_s=run.get("healthy_after_s"), ttft_s=run.get("ttft_s"),
        tokens_per_s=run.get("decode_tokens_per_s"), completion=(run.get("completion") or {}).get("text"),
        baseline=(f"{run['baseline']['matched']}/{run['baseline']['compared']}" if run.get("baseline") else None),
        engine_error=facts.get("error") if run.get("status") != "passed" else None,
        error=err.splitlines()[0][:300] if err else None, log=run.get("log"))
    return r


# Doctor checks about the machine rather than the artifact: a refusal for these is not worth a vLLM start.
ENVIRONMENT_CHECKS = ("engine python", "engine installed", "cuda")


def refusal(smoke: dict[str, Any] | None) -> str | None:
    """Doctor's reason when it refused the artifact itself (not the environment), else None."""
    run = ((smoke or {}).get("runs") or [{}])[0]
    if run.get("status") != "refused":
        return None
    fails = [c for c in (smoke or {}).get("doctor", {}).get("checks", []) if c["status"] == "fail"]
    if not fails or any(c["name"] in ENVIRONMENT_CHECKS for c in fails):
        return None
    return "; ".join(f"{c['name']}: {c['message']}" for c in fails)[:300]


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| artifact | method | format | scheme | doctor predicted | loads | vLLM quantization | "
            "kernel vLLM picked | ready s | TTFT ms | decode tok/s | greedy vs baseline | error |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        kern = "<br>".join(r.get("kernels") or []) or ", ".join(r.get("schemes") or []) or "-"
        err = r.get("engine_error") or r.get("error") or ""
        said = r.get("doctor_predicted") or "-"
        cells = [r["artifact"], r.get("method") or "-", r.get("format") or "-", _scheme(r),
                 said if said in ("loads", "-") else f"fails ({said})".replace("|", "\\|"), r.get("loads") or "-",
                 r.get("quantization") or "-", kern, _num(r.get("ready_s"), 0), _num((r.get("ttft_s") or 0) * 1000
                 if r.get("ttft_s") is not None else None, 0), _num(r.get("tokens_per_s"), 1),
                 r.get("baseline") or "-", err.replace("|", "\\|")[:200]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    versions = {(r.get("vllm"), r.get("ct_written"), r.get("ct_read")) for r in rows if r.get("vllm")}
    for v, w, rd in sorted(versions, key=str):
        lines.append(f"\nvLLM {v}; artifacts written with compressed-tensors {w}, read by vLLM with {rd}.")
    return "\n".join(lines) + "\n"


def _scheme(r: dict[str, Any]) -> str:
    parts = [str(r.get("scheme") or "-")]
    if r.get("strategy"):
        parts.append(str(r["strategy"]) + (f" {r['group_size']}" if r.get("group_size") not in (None, -1) else ""))
    return " ".join(parts)


def _num(v: Any, nd: int) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


class Runner:
    """Start artifacts on free GPU slots within the budget; collect their JSON as they finish."""

    def __init__(self, args: argparse.Namespace, arts: list[Path], qk_env: dict[str, str]) -> None:
        self.args, self.arts, self.qk_env = args, arts, qk_env
        self.t0 = time.monotonic()
        self.rows: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        (args.out / "smoke").mkdir(parents=True, exist_ok=True)
        (args.out / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def command(self, art: Path, info: dict[str, Any], timeout: float) -> list[str]:
        a = self.args
        cmd = [a.python, "-m", "quantkit", "smoke", str(art), "--engine", "vllm", "--python", a.python,
               "--env", f"PYTHONPATH={a.vllm_site}", "--env", "VLLM_USE_FLASHINFER_SAMPLER=0", "--json",
               "--log-dir", str(a.out / "logs" / name_of(art)), "--timeout", str(int(timeout)),
               "--gpu-memory-utilization", f"{min(0.5, 0.8 / a.per_gpu):.2f}"]
        src = info.get("source")
        if a.baseline and src and (Path(src) / "config.json").exists():
            cmd += ["--baseline", "source"]
        return cmd + list(a.extra)

    def one(self, art: Path, gpu: int) -> None:
        info = describe(art)
        smoke, note = self.smoke(art, info, gpu, [])
        reason = refusal(smoke)
        refused = ((smoke or {}).get("runs") or [{}])[0].get("status") == "refused"
        predicted = reason or ("-" if refused or smoke is None else "loads")
        if reason and self.args.confirm_refusals:
            # doctor predicts vLLM will not load it: start vLLM anyway, to record vLLM's own error beside it
            smoke, note = self.smoke(art, info, gpu, ["--skip-doctor"])
        self.record(art, info, smoke, note, predicted)
        r = self.rows[str(art)]
        print(f"[{time.monotonic() - self.t0:5.0f}s] GPU {gpu}: {r['artifact']}: loads={r.get('loads')} "
              f"kernels={r.get('kernels')} tok/s={r.get('tokens_per_s')} {r.get('error') or ''}", flush=True)

    def smoke(self, art: Path, info: dict[str, Any], gpu: int,
              extra: list[str]) -> tuple[dict[str, Any] | None, str | None]:
        """One ``quantkit smoke`` process within the budget: its JSON, or a note on why there is none."""
        left = self.left()
        if left < self.args.min_start:
            return None, f"not started: {left:.0f}s of the budget left"
        timeout = max(60.0, min(self.args.timeout, left - 60))
        env = {**self.qk_env, "CUDA_VISIBLE_DEVICES": str(gpu)}
        cmd = self.command(art, info, timeout) + extra
        print(f"[{time.monotonic() - self.t0:5.0f}s] GPU {gpu}: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=max(30.0, self.left() - 5))
        except subprocess.TimeoutExpired:
            proc.terminate()  # quantkit turns SIGTERM into a clean stop of its server
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
        tag = name_of(art) + ("-skip-doctor" if extra else "")
        (self.args.out / "smoke" / f"{tag}.stderr.txt").write_text(err or "")
        try:
            smoke = json.loads(out) if out.strip() else None
        except json.JSONDecodeError:
            smoke = None
        if smoke is None:
            return None, f"quantkit smoke exited {proc.returncode}: {(err or '').strip()[-300:]}"
        (self.args.out / "smoke" / f"{tag}.json").write_text(json.dumps(smoke, indent=2))
        return smoke, None

    def record(self, art: Path, info: dict[str, Any], smoke: dict[str, Any] | None, note: str | None,
               predicted: str) -> None:
        with self.lock:
            self.rows[str(art)] = {**row(art, info, smoke, note), "doctor_predicted": predicted}
            rows = [self.rows[str(a)] for a in self.arts if str(a) in self.rows]
            (self.args.out / "gpu_smoke.json").write_text(json.dumps(rows, indent=2))
            (self.args.out / "gpu_smoke.md").write_text(markdown(rows))

    def slot(self, gpu: int, k: int, queue: list[Path]) -> None:
        if k:
            time.sleep(k * self.args.stagger)
        while True:
            with self.lock:
                if not queue:
                    return
                art = queue.pop(0)
            self.one(art, gpu)

    def run(self) -> None:
        queue = list(self.arts)
        gpus = self.args.gpus or gpu_count()
        threads = [threading.Thread(target=self.slot, args=(g, k, queue), daemon=True)
                   for k in range(self.args.per_gpu) for g in range(gpus)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    arts = expand(args.artifacts)
    if not arts:
        sys.exit("no artifact folders given")
    qk_path = ":".join(p for p in (str(REPO), args.quantkit_site if Path(args.quantkit_site).is_dir() else "") if p)
    qk_env = {**os.environ, "PYTHONPATH": qk_path, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}
    preflight(args, qk_env)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(arts)} artifacts, budget {args.budget:.0f}s, vLLM from {args.vllm_site}, quantkit with "
          f"PYTHONPATH={qk_path}", flush=True)
    runner = Runner(args, arts, qk_env)
    runner.run()
    print((args.out / "gpu_smoke.md").read_text())
    if shutil.which("nvidia-smi"):
        left = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
        print(f"GPU processes still running: {left or 'none'}")


if __name__ == "__main__":
    main()
