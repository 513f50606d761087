"""The MoE load alone: quantkit's ``load_model`` against llm-compressor's ``load_context()``, wall and peak memory.

    python bench/moe_load.py SRC [--repeat 3] [--modes quantkit,load_context] [--name moe_load_qwen3-30b-a3b-2l]

A before/after comparison runs it twice, the first time with an older quantkit first on PYTHONPATH (``git archive
COMMIT quantkit | tar -x -C DIR``; the table then names DIR for that row). SRC is a checkpoint with per-expert
tensors, e.g. ``bench/quantize_cost.py --shape qwen3-30b-a3b-2l --prepare``'s
``WORKDIR/src-qwen3-30b-a3b-2l``. Each run is its own process (nothing cached between them but the page cache,
warmed by one untimed read of the files first); the wall is the load alone (the call, not the interpreter or the
imports), the peak anonymous RSS is sampled every 20 ms from /proc (the file-backed pages of mmapped safetensors
are the page cache's, not the process's, and come back under pressure), the peak RSS is the kernel's VmHWM.

Why: on an H100 the FP8 run of Qwen3-30B-A3B's shape spent 78.5 s loading through quantkit against llm-compressor's
direct script's faster load, with 56.5 GiB peak anonymous RSS against 29.6 GiB; this says where, on any machine.

``load_context`` needs torchvision in transformers 5.17 (its class patching lists every module, and the
backward-compatibility aliases of the image processors import them); where torchvision is missing that mode hides
those aliases from ``sys.modules`` for the load, which this measurement needs and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODES = ("quantkit", "load_context")


def _anon_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def child(mode: str, src: str) -> None:
    """One load in this process; prints one JSON line."""
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    import transformers  # noqa: F401  (imports are not the load)
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    from quantkit.producers import oneshot
    from quantkit.producers.job import Job

    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _anon_bytes())
            time.sleep(0.02)

    config = json.loads((Path(src) / "config.json").read_text())
    base = _anon_bytes()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    if mode == "quantkit":
        job = Job.model_construct(source=src, config=config, dtype="auto", trust_remote_code=False)
        model = oneshot.load_model(job)
    else:
        import importlib.util

        from llmcompressor.utils import load_context
        from transformers import AutoModelForCausalLM

        from quantkit.producers.moe import image_aliases_hidden

        hidden = image_aliases_hidden() if importlib.util.find_spec("torchvision") is None else contextlib.nullcontext()
        with hidden, load_context():
            model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    peak[0] = max(peak[0], _anon_bytes())
    linear = sum(isinstance(m, LinearExperts2D) for m in model.modules())
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    import quantkit

    print("moe-load: " + json.dumps({"mode": mode, "wall_s": wall, "peak_anon_bytes": peak[0],
                                     "quantkit_from": str(Path(quantkit.__file__).resolve().parents[1]),
                                     "anon_before_bytes": base, "peak_rss_bytes": hwm,
                                     "linear_expert_blocks": linear}), flush=True)


def run(mode: str, src: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(src)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)})
    line = next((x for x in out.stdout.splitlines() if x.startswith("moe-load: ")), None)
    if out.returncode or line is None:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [""]
        return {"mode": mode, "rc": out.returncode, "error": tail[0][:300]}
    return {"rc": 0, **json.loads(line.removeprefix("moe-load: "))}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, nargs="?")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--name", default=None,
                    help="result file name in bench/results [default: moe_load_SRCNAME]")
    ap.add_argument("--label", default="", help="what this run measures (before/after a change), kept in the JSON")
    ap.add_argument("--append", action="store_true", help="add to the runs already in NAME.json")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "SRC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.src is None:
        ap.error("SRC is required")
    for f in sorted(args.src.glob("*.safetensors")):  # warm the page cache: every run reads from memory
        with f.open("rb") as fh:
            while fh.read(1 << 24):
                pass
    name = args.name or f"moe_load_{args.src.name.removeprefix('src-')}"
    path = RESULTS / f"{name}.json"
    data = json.loads(path.read_text()) if args.append and path.exists() else {"runs": []}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--", "quantkit"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip():
        commit += "+changes"
    for mode in args.modes.split(","):
        runs = [run(mode, args.src) for _ in range(args.repeat)]
        ok = [r for r in runs if r["rc"] == 0]
        entry: dict[str, Any] = {"mode": mode, "label": args.label, "commit": commit, "runs": runs}
        if ok and ok[0]["quantkit_from"] != str(ROOT):  # an older quantkit put first on PYTHONPATH
            entry["commit"] = f"quantkit from {ok[0]['quantkit_from']}"
        if ok:
            for key in ("wall_s", "peak_anon_bytes", "peak_rss_bytes"):
                entry[f"median_{key}"] = statistics.median(r[key] for r in ok)
        print(json.dumps({k: v for k, v in entry.items() if k != "runs"}), flush=True)
        data["runs"].append(entry)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH", "OMP_NUM_THREADS") if k in os.environ]
    data.setdefault("commands", []).append(" ".join([*env, "python", "bench/moe_load.py", shlex.join(sys.argv[1:])]))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    data["machine"] = (f"{platform.machine()} CPU only, {os.cpu_count()} cores, {gib(ram)} RAM, "
                       f"Python {platform.python_version()}")
    data["source"] = {"folder": args.src.name,
                      "architectures": json.loads((args.src / "config.json").read_text()).get("architectures"),
                      "bytes": sum(f.stat().st_size for f in args.src.glob("*.safetensors"))}
    path.write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(render(data))


def render(data: dict[str, Any]) -> str:
    """The markdown table of NAME.json."""
    src = data["source"]
    lines = [f"# MoE load alone: {src['folder']} ({', '.join(src['architectures'])}, {gib(src['bytes'])} bf16)", "",
             "; ".join(f"`{c}`" for c in data["commands"])
             + f" on {data['machine']}; medians of the runs (each its own process, the page cache warm).", "",
             "| mode | label | commit | runs | load wall (min-max) | peak anon RSS | peak RSS (VmHWM) |",
             "|---|---|---|---|---|---|---|"]
    for e in data["runs"]:
        if "median_wall_s" not in e:
            lines.append(f"| {e['mode']} | {e['label']} | {e['commit']} | failed: {e['runs'][0].get('error')} "
                         "| | | |")
            continue
        walls = [r["wall_s"] for r in e["runs"] if r["rc"] == 0]
        lines.append(f"| {e['mode']} | {e['label']} | {e['commit']} | {len(walls)} | {e['median_wall_s']:.2f} s "
                     f"({min(walls):.2f}-{max(walls):.2f}) | {gib(e['median_peak_anon_bytes'])} | "
                     f"{gib(e['median_peak_rss_bytes'])} |")
    lines += ["", "quantkit = `quantkit.producers.oneshot.load_model` as the commit had it (\"+changes\": with the "
              "working tree's uncommitted changes to quantkit/); load_context = llm-compressor's `load_context()` "
              "around `AutoModelForCausalLM.from_pretrained(src, dtype=\"auto\")`, as its examples load an MoE model "
              "(without torchvision, the image processors' aliases hidden for the load: see the script's "
              "docstring). Peak anon RSS is the process's own memory; the rest of VmHWM is the checkpoint's "
              "mapped pages, which the page cache holds and gives back. A load that builds the per-expert Linears "
              "from the checkpoint reads none of the weights yet (VmHWM stays near the imports'): their pages are "
              "read at first use, in the quantization step, so the whole run's wall is what says what it saves.", ""]
    if data.get("end_to_end"):
        e2e = data["end_to_end"]
        lines += ["## The whole run", "", f"`{e2e['command']}` ({e2e['how']}), runs in the order given:", "",
                  "| quantkit | wall | load_model step | quantize step | save step | peak anon RSS | peak RSS |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['tag']} | {r['wall_s']:.1f} s | {r['timings']['load_model']:.1f} s | "
                  f"{r['timings']['quantize']:.1f} s | {r['timings']['save']:.1f} s | {r['peak_anon_gib']:.2f} GiB | "
                  f"{r['peak_rss_gib']:.2f} GiB |" for r in e2e["runs"]]
        lines += ["", e2e["reading"], ""]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
