"""32B-class widths on one GPU (issue 44 item 3): Qwen2.5-32B's dense shape and Qwen3-30B-A3B's MoE shape (or their
widths with fewer layers), GPTQ, AWQ and FP8 static through quantkit and through llm-compressor directly on the same
calibration tokens, each quantkit artifact (and the bf16 source) served by vLLM, with a memory plan against the
machine printed first and every case that would not fit or finish skipped with the reason, before it starts.

    python bench/wide.py --dry-run                                     # the plan and every command; runs nothing
    python bench/wide.py --shapes 32b-8l --methods fp8-static,gptq --budget-s 420 \
        --vllm-python ~/vllm/bin/python                                # one H200: a short run
    python bench/wide.py --only '32b-8l/fp8-static/*' --vllm-path /opt/vllm-site

Cases are named SHAPE/build, SHAPE/METHOD/TOOL (TOOL quantkit or llm-compressor) and SHAPE/ARTIFACT/serve (ARTIFACT
bf16 or a method); ``--only`` takes names or shell patterns (comma-separated). For each shape:

1. **The plan, before any work.** A header-only checkpoint of the shape (bench/header_only.py: real headers,
   sparse data) is planned by ``quantkit METHOD ... --dry-run --json --device cuda`` with the run's calibration:
   peak host and GPU memory (quantkit/plan.py's memory model) and the output's size. Against the machine (GPU
   memory from nvidia-smi, host memory as quantkit reads it, free disk under ``--workdir``; ``--gpu-bytes``,
   ``--host-bytes``, ``--disk-bytes`` say them for a machine planned from elsewhere) and the time left in
   ``--budget-s`` (bench/cost_model.py's FLOP estimate for GPTQ and FP8; AWQ 1.8 times GPTQ, the 8B shape's measured
   ratio; a vLLM start from the bytes it loads), each case runs or is skipped with one line saying why. The disk
   must hold the source, quantkit's outputs until they are served (then deleted) and one direct output (deleted
   once measured); the host the plan's floor; the GPU the plan's peak, and for serving the checkpoint in 85% of it.
2. **The source**: random bf16 weights made on the GPU in bf16 (a 32B model would not fit the GPU in float32),
   saved in 5 GB shards with the reference model's tokenizer; calibration ``--samples`` x ``--seq-len`` tokens of
   the shipped text, the same token ids for both tools (bench/quantize_cost.py's inputs).
3. **Each method and tool**, one process at a time, ``--repeat`` times: wall, peak host RSS (and its anonymous
   part) sampled from /proc, peak GPU from nvidia-smi sampling (memory used above the level at start) and
   ``torch.cuda.max_memory_allocated`` inside the process (bench/cuda_peak.py). The direct script is
   bench/quantize_cost.py's (llm-compressor 0.14's examples; for the MoE its Qwen3-MoE example).
4. **Serving**: bench/serve_speed.py's measurement in vLLM's Python (offline, CUDA graphs for the measured
   batches): TTFT and decode tok/s at ``--batches`` (1 and 16), of the bf16 source and quantkit's artifacts.

Writes ``--results-dir`` (bench/results/h200/wide)/{results.json,README.md} after every case. vLLM's Python:
``--vllm-python`` (else QUANTKIT_VLLM_PYTHON, else ``vllm`` on PATH: quantkit/envs.py), ``--vllm-path DIR`` for a
``pip install --target`` folder put on its PYTHONPATH, as in scripts/gpu_cases.py.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_model  # noqa: E402
import header_only  # noqa: E402
import meta  # noqa: E402
import quantize_cost  # noqa: E402
from shapes import BUILDABLE, SHAPES  # noqa: E402

BENCH = Path(__file__).resolve().parent
H200_GPU_BYTES = 141_000_000_000  # assumed where no GPU is visible (a plan made elsewhere), and said
SERVE_SHARE = 0.85  # vLLM's --gpu-memory-utilization in serve_speed: the checkpoint must fit in it
AWQ_OVER_GPTQ = 1.8  # AWQ's wall over GPTQ's on the 8B shape, 32 x 2048 tokens (190.8 s / 108.2 s, H200)
VLLM_START_S = 90.0  # vLLM's start, graph capture and measurement beyond loading (the 8B runs: 60-120 s)
LOAD_BYTES_S = 1.5e9  # vLLM's load from the page cache
BUILD_BYTES_S = 0.5e9  # random init on the GPU and save_pretrained to disk, per bf16 byte
DISK_MARGIN = 2_000_000_000  # logs, tokenizer, the calibration file
DEFAULT_METHODS = ["gptq", "awq", "fp8-static"]


@dataclass
class Case:
    """One step: its name, the command it runs, its estimate and the verdict of the plan."""

    name: str
    kind: str  # build | quantize | serve
    shape: str
    method: str = ""
    tool: str = ""
    estimate_s: float = 0.0
    host_bytes: int = 0
    gpu_bytes: int = 0
    disk_bytes: int = 0
    skip: str = ""  # why it does not run ("" = it runs)
    command: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Machine:
    gpu_bytes: int
    host_bytes: int
    disk_bytes: int
    said: list[str]


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def machine(args: argparse.Namespace) -> Machine:
    """What the cases must fit in: the GPU, the host's memory, the free disk under the workdir (each overridable)."""
    from quantkit.plan import host_limit

    said = []
    gpu = args.gpu_bytes
    if gpu is None:
        totals = meta.gpus()
        if totals:
            gpu = int(float(totals[0].split(",")[-1].split()[0]) * 2**20)  # "NVIDIA H200, 143771 MiB"
        else:
            gpu = H200_GPU_BYTES
            said.append(f"no GPU visible: planned for one H200 ({gb(gpu)})")
    host = args.host_bytes or (host_limit() or (0, ""))[0]
    args.workdir.mkdir(parents=True, exist_ok=True)
    disk = args.disk_bytes or shutil.disk_usage(args.workdir).free
    return Machine(gpu, host, disk, said)


def plan_outputs(shape: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """quantkit's own --dry-run of each method on a header-only checkpoint of ``shape``: its plan by method."""
    hdr = header_only.write(shape, args.workdir / f"header-{shape}")
    out = {}
    for method in args.methods:
        verb, flags = quantize_cost.METHODS[method]
        argv = [sys.executable, "-m", "quantkit", verb, str(hdr), str(args.workdir / "planned"), *flags,
                "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--device", args.device, "--dry-run",
                "--json"]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=meta.ROOT)
        if proc.returncode:
            raise SystemExit(f"quantkit's plan of {shape} {method} failed: {proc.stderr.strip()[-500:]}")
        out[method] = {**json.loads(proc.stdout)["outputs"][0], "source_bytes": json.loads(proc.stdout)["source"][
            "size_bytes"]}
    return out


def shallower(shape: str) -> list[str]:
    """The shapes of bench/shapes.py with ``shape``'s width and fewer layers."""
    width = {k: v for k, v in SHAPES[shape].config().items() if k not in ("num_hidden_layers", "max_window_layers")}
    depth = SHAPES[shape].fields["num_hidden_layers"]
    return [name for name, s in BUILDABLE.items() if s.fields["num_hidden_layers"] < depth
            and {k: v for k, v in s.config().items() if k not in ("num_hidden_layers", "max_window_layers")} == width]


def quantize_estimate(shape: str, method: str, samples: int, seq_len: int) -> float:
    """Seconds one tool takes (bench/cost_model.py; AWQ from GPTQ by the measured ratio; INT8 as GPTQ)."""
    base = "fp8-static" if method == "fp8-static" else "gptq"
    s = cost_model.estimate(SHAPES[shape], base, samples, seq_len)["wall_s"]
    return s * AWQ_OVER_GPTQ if method == "awq" else s


def cases(args: argparse.Namespace, m: Machine) -> list[Case]:
    """Every case in order, each with its estimate and whether it fits; ``--only`` and the budget applied."""
    out: list[Case] = []
    left = args.budget_s
    wanted = lambda name: not args.only or any(fnmatch.fnmatch(name, p) for p in args.only)  # noqa: E731
    for shape in args.shapes:
        plans = plan_outputs(shape, args)
        source = next(iter(plans.values()))["source_bytes"]
        largest = max(p["disk_bytes"] for p in plans.values())
        build = Case(f"{shape}/build", "build", shape, estimate_s=source / BUILD_BYTES_S, disk_bytes=source,
                     command=[sys.executable, str(BENCH / "wide.py"), "--build", shape,
                              str(args.workdir / f"src-{shape}")])
        kept = sum(p["disk_bytes"] for p in plans.values()) if args.serve and "quantkit" in args.tools else 0
        need = source + kept + largest + DISK_MARGIN
        if need > m.disk_bytes:
            build.skip = (f"disk: the {gb(source)} source, {gb(kept)} of quantkit outputs kept to be served and "
                          f"one more output ({gb(largest)}) need {gb(need)}, {args.workdir} has {gb(m.disk_bytes)} free"
                          + (f" (its width with fewer layers: {', '.join(shallower(shape))})"
                             if shallower(shape) else ""))
        todo: list[Case] = []
        for method in args.methods:
            p = plans[method]
            for tool in args.tools:
                todo.append(Case(f"{shape}/{method}/{tool}", "quantize", shape, method, tool,
                                 estimate_s=quantize_estimate(shape, method, args.samples, args.seq_len) * args.repeat,
                                 host_bytes=p["host_bytes"], gpu_bytes=p["gpu_bytes"],
                                 disk_bytes=source + p["disk_bytes"]))
        if args.serve:
            for name, size in [("bf16", source), *((meth, plans[meth]["disk_bytes"]) for meth in args.methods)]:
                todo.append(Case(f"{shape}/{name}/serve", "serve", shape, "" if name == "bf16" else name,
                                 estimate_s=VLLM_START_S + size / LOAD_BYTES_S, gpu_bytes=size))
        needed = [c for c in todo if wanted(c.name)]
        if needed and not wanted(build.name) and (args.workdir / f"src-{shape}" / "bench-config.json").exists():
            build.skip = "the source is already built (--only left it out)"
        elif not needed and not wanted(build.name):
            continue
        for c in [build, *needed]:
            if build.skip and c is not build and not build.skip.startswith("the source is already"):
                c.skip = f"no source ({build.name} is skipped)"
            elif c.host_bytes > m.host_bytes:
                c.skip = f"host memory: the plan's floor is {gb(c.host_bytes)}, the machine allows {gb(m.host_bytes)}"
            elif c.kind == "quantize" and c.gpu_bytes > m.gpu_bytes:
                c.skip = f"GPU memory: the plan's peak is {gb(c.gpu_bytes)}, the GPU has {gb(m.gpu_bytes)}"
            elif c.kind == "serve" and c.gpu_bytes > SERVE_SHARE * m.gpu_bytes:
                c.skip = (f"GPU memory: the {gb(c.gpu_bytes)} checkpoint exceeds vLLM's {SERVE_SHARE:.0%} of "
                          f"{gb(m.gpu_bytes)}")
            elif c.kind == "serve" and c.method and not any(x.method == c.method and x.tool == "quantkit"
                                                           and not x.skip for x in out + needed):
                c.skip = "quantkit's artifact of it is not made in this run"
            elif left is not None and c.estimate_s > left and not (c is build and build.skip):
                c.skip = f"budget: estimated {c.estimate_s:.0f} s, {max(left, 0):.0f} s of --budget-s left"
            if not c.skip and left is not None:
                left -= c.estimate_s
            out.append(c)
        if not build.skip and all(c.skip for c in needed):
            build.skip = "none of its cases runs"
            left = None if left is None else left + build.estimate_s
    return out


# ----------------------------------------------------------------------------------------------------------------
# Running


def build(shape: str, folder: Path) -> None:
    """A random bf16 checkpoint of ``shape`` made in bf16 on the GPU (float32 first would double it), 5 GB shards,
    the reference model's tokenizer; reused when one with the same config is there."""
    import torch
    import transformers

    cfg = header_only.config(shape)
    stamp = folder / "bench-config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, SHAPES[shape].architecture)(transformers.AutoConfig.for_model(**cfg))
    model.save_pretrained(str(folder), max_shard_size="5GB")
    transformers.AutoTokenizer.from_pretrained(header_only.TINY).save_pretrained(str(folder))
    stamp.write_text(json.dumps(cfg))


def quantize_command(c: Case, args: argparse.Namespace, inputs: dict[str, Path], peak: Path) -> list[str]:
    """The timed process: quantkit's CLI or the direct script, under bench/cuda_peak.py."""
    out = args.workdir / f"out-{c.shape}-{c.method}-{c.tool}"
    head = [sys.executable, str(BENCH / "cuda_peak.py"), str(peak)]
    if c.tool == "quantkit":
        verb, flags = quantize_cost.METHODS[c.method]
        return head + ["-m", "quantkit", verb, str(inputs["src"]), str(out), *flags, "--calib", str(inputs["calib"]),
                       "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--device", args.device,
                       "--force", "--json"]
    return head + [str(BENCH / "quantize_cost.py"), "--direct", c.method, str(inputs["src"]), str(out),
                   str(inputs["tokens"])]


def run_quantize(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """``--repeat`` runs of one case (the median kept, every wall beside it); the direct output deleted after."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "LLM_COMPRESSOR_LOG_LEVEL": os.environ.get("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")}
    out = args.workdir / f"out-{c.shape}-{c.method}-{c.tool}"
    tries = []
    for k in range(args.repeat):
        peak = args.workdir / f"peak-{c.shape}-{c.method}-{c.tool}-{k}.json"
        shutil.rmtree(out, ignore_errors=True)
        r = quantize_cost.measure(quantize_command(c, args, inputs, peak), args.logs / f"{c.name.replace('/', '-')}"
                                  f"-{k}.log", env)
        r.pop("stdout", None)
        r.update(json.loads(peak.read_text()) if peak.exists() else {})
        r["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.exists() else 0
        if r["rc"]:
            tail = [ln for ln in Path(r["log"]).read_text(errors="replace").splitlines() if ln.strip()]
            r["error"] = tail[-1].strip()[:300] if tail else ""
        tries.append(r)
    if c.tool != "quantkit" or not args.serve:
        shutil.rmtree(out, ignore_errors=True)
    return quantize_cost.median_run(tries)


def run_serve(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """bench/serve_speed.py's measurement of one checkpoint; quantkit's artifact deleted after it."""
    import serve_speed

    folder = inputs["src"] if not c.method else args.workdir / f"out-{c.shape}-{c.method}-quantkit"
    if not (folder / "config.json").exists():
        return {"error": f"{folder} is not there (its quantization failed)"}
    ns = argparse.Namespace(python=args.vllm_python, vllm_path=args.vllm_path, kernels=False,
                            batches=args.batches, prompt_len=512, gen=128, max_model_len=2048, capture_all=False,
                            logs=args.logs, timeout=900.0, bandwidth=serve_speed.H200_BANDWIDTH)
    row = serve_speed.run_one(folder, ns)
    if c.method:
        shutil.rmtree(folder, ignore_errors=True)
    return row


# ----------------------------------------------------------------------------------------------------------------
# Results


def plan_text(all_cases: list[Case], m: Machine, args: argparse.Namespace) -> str:
    lines = [f"machine: GPU {gb(m.gpu_bytes)}, host memory {gb(m.host_bytes)}, free disk under {args.workdir} "
             f"{gb(m.disk_bytes)}" + "".join(f"; {s}" for s in m.said),
             f"calibration {args.samples} x {args.seq_len} tokens, {args.repeat} run(s) per tool; budget "
             + (f"{args.budget_s:.0f} s" if args.budget_s is not None else "none")]
    for c in all_cases:
        mem = (f"host {gb(c.host_bytes)}, GPU {gb(c.gpu_bytes)}, " if c.kind == "quantize" else
               f"checkpoint {gb(c.gpu_bytes)}, " if c.kind == "serve" else f"disk {gb(c.disk_bytes)}, ")
        lines.append(f"  {'skip' if c.skip else 'run '} {c.name:<34} {mem}~{c.estimate_s:.0f} s"
                     + (f": {c.skip}" if c.skip else ""))
    run = [c for c in all_cases if not c.skip]
    lines.append(f"{len(run)} of {len(all_cases)} cases run, about {sum(c.estimate_s for c in run) / 60:.1f} min")
    return "\n".join(lines)


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def readme(data: dict[str, Any]) -> str:
    lines = ["# 32B-class widths on one GPU (issue 44 item 3)", "", meta.md_header(data),
             "Written by bench/wide.py (its docstring says what each figure is). The plan it printed first:", "",
             "```", data["plan"], "```", "",
             "| case | rc | wall | peak GPU (nvidia-smi) | torch max allocated | peak host RSS (anon) | output |",
             "|---|---|---|---|---|---|---|"]
    for c in data["cases"]:
        r = c["result"]
        if c["kind"] != "quantize" or not r:
            continue
        lines.append(f"| {c['name']} | {r['rc']} | {r['wall_s']:.1f} s | {gib(r.get('peak_gpu_bytes'))} | "
                     f"{gib(r.get('max_memory_allocated'))} | {gib(r.get('peak_rss_bytes'))} "
                     f"({gib(r.get('peak_anon_rss_bytes'))}) | {r.get('output_bytes', 0) / 1e9:.1f} GB |")
    batches = data["batches"]
    served = [c for c in data["cases"] if c["kind"] == "serve" and c["result"]]
    if served:
        lines += ["", "| served | kernel | TTFT | " + " | ".join(f"decode tok/s b{b}" for b in batches) + " |",
                  "|---|---|---|" + "---|" * len(batches)]
    for c in served:
        r = c["result"]
        cells = [f"{r[f'b{b}']['decode_tok_s']:.0f}" if r.get(f"b{b}") else "-" for b in batches]
        ttft = f"{r['ttft_s'] * 1000:.0f} ms" if r.get("ttft_s") else f"`{(r.get('error') or '')[:120]}`"
        lines.append(f"| {c['name']} | {'; '.join(r.get('kernels') or []) or '-'} | {ttft} | " + " | ".join(cells)
                     + " |")
    skipped = [f"- {c['name']}: {c['skip']}" for c in data["cases"] if c["skip"]]
    if skipped:
        lines += ["", "Skipped before starting:", "", *skipped]
    return "\n".join(lines) + "\n"


def save(data: dict[str, Any], all_cases: list[Case], folder: Path) -> None:
    data["cases"] = [asdict(c) for c in all_cases]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (folder / "README.md").write_text(readme(data))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--build":
        build(sys.argv[2], Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--shapes", type=split, default=["32b", "qwen3-30b-a3b"], help="bench/shapes.py names")
    ap.add_argument("--methods", type=split, default=DEFAULT_METHODS, help="from bench/quantize_cost.py's")
    ap.add_argument("--tools", type=split, default=["quantkit", "llm-compressor"])
    ap.add_argument("--only", type=split, default=[], help="case names or shell patterns, comma-separated")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1, help="runs per method and tool (the median is kept)")
    ap.add_argument("--budget-s", type=float, help="skip a case whose estimate exceeds what is left of this")
    ap.add_argument("--device", default="cuda", help="quantkit's --device (cpu: a logic check of this script)")
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="quantize only")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in split(s)], default=[1, 16])
    ap.add_argument("--vllm-python", help="vLLM's Python [default: quantkit's rule, quantkit/envs.py]")
    ap.add_argument("--vllm-path", help="a pip install --target folder put on vLLM's PYTHONPATH")
    ap.add_argument("--gpu-bytes", type=float, help="plan for this much GPU memory [default: nvidia-smi's]")
    ap.add_argument("--host-bytes", type=float, help="plan for this much host memory [default: quantkit's reading]")
    ap.add_argument("--disk-bytes", type=float, help="plan for this much free disk [default: under --workdir]")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-wide"))
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS / "h200" / "wide")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/quantkit-bench-wide/logs"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan and every command; run nothing")
    args = ap.parse_args()
    bad = [s for s in args.shapes if s not in BUILDABLE] + [x for x in args.methods if x not in quantize_cost.METHODS] \
        + [t for t in args.tools if t not in ("quantkit", "llm-compressor")]
    if bad:
        ap.error(f"unknown shape, method or tool: {', '.join(bad)}")
    for name in ("gpu_bytes", "host_bytes", "disk_bytes"):
        setattr(args, name, None if getattr(args, name) is None else int(getattr(args, name)))
    m = machine(args)
    all_cases = cases(args, m)
    plan = plan_text(all_cases, m, args)
    print(plan, flush=True)
    inputs_of = lambda shape: {"src": args.workdir / f"src-{shape}", "calib": args.workdir / "calib.jsonl.gz",  # noqa
                               "tokens": args.workdir / "tokens.json"}
    if args.dry_run:
        for c in all_cases:
            if c.kind == "quantize":
                c.command = quantize_command(c, args, inputs_of(c.shape), args.workdir / "peak.json")
            if not c.skip:
                print(f"{c.name}: " + (shlex.join(c.command) if c.command else
                                       f"bench/serve_speed.py's run_one in {args.vllm_python or 'vLLM'}'s Python"))
        return
    if any(c.kind == "serve" and not c.skip for c in all_cases):
        from quantkit.engines import registry
        from quantkit.formats.names import VLLM

        args.vllm_python = registry.get(VLLM).find_python(args.vllm_python).python
    args.logs.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {**meta.header(), "plan": plan, "samples": args.samples, "seq_len": args.seq_len,
                            "batches": args.batches}
    for c in all_cases:
        if c.skip:
            continue
        print(f"== {c.name}", flush=True)
        inputs = inputs_of(c.shape)
        t0 = time.perf_counter()
        if c.kind == "build":
            proc = subprocess.run(c.command, cwd=meta.ROOT)
            ns = argparse.Namespace(workdir=args.workdir, shape=c.shape, samples=args.samples, seq_len=args.seq_len)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(inputs["src"]) if proc.returncode == 0 else None
            if tok is not None:
                quantize_cost.make_calibration(inputs["calib"], ns.samples, ns.seq_len, tok)
                samples, sha = quantize_cost.calibration_tokens(inputs["calib"], ns.samples, ns.seq_len, tok)
                inputs["tokens"].write_text(json.dumps(samples))
                data.setdefault("tokens_sha256", {})[c.shape] = sha
            c.result = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
        elif c.kind == "quantize":
            c.command = quantize_command(c, args, inputs, args.workdir / "peak.json")
            c.result = run_quantize(c, args, inputs)
        else:
            c.result = run_serve(c, args, inputs)
        print(f"   {json.dumps({k: v for k, v in c.result.items() if not isinstance(v, (dict, list))})[:400]}",
              flush=True)
        save(data, all_cases, args.results_dir)
    save(data, all_cases, args.results_dir)


if __name__ == "__main__":
    main()
