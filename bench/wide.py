"""Wide models on one machine's GPUs (issue 44 item 3, issue 43): Qwen2.5-32B's dense shape, Qwen3-30B-A3B's MoE
shape and Llama-3.1-70B's (or their widths with fewer layers), GPTQ, AWQ and FP8 static through quantkit and through
llm-compressor directly on the same calibration tokens, on one GPU or spread over ``--num-gpus``, each quantkit
artifact smoke-tested, served by vLLM with tensor parallelism at each ``--tp`` size and, given two, scored by
``quantkit eval`` at each, with a memory plan against the machine printed first and every case that would not fit or
finish skipped with the reason, before it starts; afterwards the plan is checked against the measured peaks.

    python bench/wide.py --dry-run                                     # the plan and every command; runs nothing
    python bench/wide.py --shapes 32b-8l --methods fp8-static,gptq --budget-s 420 \
        --vllm-python ~/vllm/bin/python                                # one H200: a short run
    python bench/wide.py --shapes 70b --methods gptq,fp8-static --num-gpus 4 --tp 4,2 --repeat 3 \
        --vllm-python ~/vllm/bin/python --workdir /data/wide           # issue 43: the 70B on four H200s
    python bench/wide.py --shapes 70b --methods gptq,fp8-static --num-gpus 2 --tp 2,1 --machine h200x2 --dry-run

Cases are named SHAPE/build, SHAPE/METHOD/TOOL (TOOL quantkit or llm-compressor), SHAPE/ARTIFACT/serve-tpN
(ARTIFACT bf16 or a method), SHAPE/METHOD/smoke-tpN and SHAPE/METHOD/eval-tpN; ``--only`` takes names or shell
patterns (comma-separated); a build it names runs even when none of its cases does (so one call can build, untimed,
and a later one time the cases). For each shape:

1. **The plan, before any work.** A header-only checkpoint of the shape (bench/header_only.py: real headers,
   sparse data) is planned by one ``quantkit run RECIPE --dry-run --json`` with an output per method, the run's
   calibration and ``--device cuda``: peak host memory and peak GPU memory per GPU (quantkit/plan.py's memory model:
   each rank of a ``--num-gpus`` run holds one layer at a time, as one GPU does) and each output's size. Against
   the machine (``--machine`` names a reference one: GPU count and memory, host memory, disk and /dev/shm; otherwise
   nvidia-smi, quantkit's reading of host memory and the free disk under ``--workdir``; ``--gpus``,
   ``--gpu-bytes``, ``--host-bytes``, ``--disk-bytes``, ``--shm-bytes`` override each) and the time left in
   ``--budget-s`` (bench/cost_model.py's FLOP estimate for GPTQ and FP8, not divided by the GPUs: two GPUs were
   slower than one for the 8B shape at this calibration size; AWQ 1.8 times GPTQ, the 8B shape's measured ratio; a
   vLLM start from the bytes it loads), each case runs or is skipped with one line saying why.
   The disk must hold the source and one output at a time (each method's direct output is measured and deleted before
   quantkit's is made; quantkit's is deleted after its last smoke, serve and eval), an output taken as the free space
   quantkit's own check asks for it before it starts (quantkit/artifact.py: the plan's figure and 10%), ``DISK_MARGIN``
   for the work folder's other files, and for ``--num-gpus`` 2 or more what llm-compressor's offloaded load spills to
   disk (the model lives in /dev/shm, shared by the ranks; what /dev/shm cannot hold, less its 5 GB reserve, goes to
   disk); where the source is built already, each quantize case's output is checked against the free disk on its own. On
   one GPU, a disk that cannot hold the source beside an output gets help from /dev/shm: the source's first shards, as
   few as leave the disk enough, are written there (less the same reserve) and linked from the source folder (the 32B
   on the one-GPU reference H200, 64 GiB of disk: 44 GB of its 65.5 GB source; they stay for the next run until
   removed). Those shards cannot leave RAM, so every case has the machine's host memory less them: the plan's host
   figure is what a quantize process holds of its own (quantkit/plan.py: the weights GPTQ, AWQ or SmoothQuant rewrite,
   every method's compressed copy), not the source's pages it maps, and eval's baseline is a copy of its own. The
   host must hold the plan's figure; one
   GPU the plan's peak; serving the checkpoint's 1/tp share in 85% of a GPU; ``quantkit eval`` its baseline, which it
   scores in transformers on the CPU in float32 (four bytes a parameter: a 70B bf16 model fits no single GPU, and
   quantkit eval puts its baseline on one device).
2. **The source**: random bf16 weights (normal, std 0.02; norms one, biases zero) written tensor by tensor in 5 GB
   safetensors shards under the names and shapes ``save_pretrained`` gives (bench/header_only.py), drawn on the GPU
   where there is one, so no step holds more than a shard (a 70B model would not fit one GPU or a small host); the
   reference model's tokenizer; calibration ``--samples`` x ``--seq-len`` tokens of the shipped text, the same
   token ids for both tools (bench/quantize_cost.py's inputs). A build that fails (rc != 0) skips every case of its
   shape left to run, each with one line saying so and the rc, and the next shape goes on.
3. **Each method and tool**, one process at a time, ``--repeat`` times (the median kept): wall; peak host memory
   as the machine's used memory (MemTotal - MemAvailable) above its level at start, which counts the /dev/shm copy
   the ranks share once, beside the summed RSS of the process tree (which counts it once per rank); peak GPU from
   nvidia-smi sampling (the sum over GPUs and each GPU's own, above the level at start) and
   ``torch.cuda.max_memory_allocated`` in a one-GPU process (bench/cuda_peak.py). With ``--num-gpus N`` quantkit
   runs with ``--num-gpus N`` and the direct script is llm-compressor 0.14's DDP example under torchrun with N ranks
   (bench/quantize_cost.py: ``load_offloaded_model`` and ``device_map="auto_offload"``); with one GPU it is its
   sequential pipeline on a model loaded to the host. Each run's steps are kept as it reports them (quantkit's
   manifest timings, the direct script's ``direct-timings``: ``quantize_cost.reported``), so a difference in wall
   time can be traced to a step. Each quantkit run that finishes (rc 0) is checked against its plan: the largest
   GPU's peak and the host's, and whether each is within 15% of the plan (``PLAN_TOLERANCE``); a
   failed run is not (its peaks are not the work planned), and its error is the line of its log that says why
   (``failure_line``: quantkit's ``error:`` line, not the hint under it; else the exception of the last traceback,
   a rank's rather than torchrun's ChildFailedError; else the last line).
4. **Each quantkit artifact at each ``--tp`` size** (one that is not there, its quantization failed, is recorded as such
   and passed over): ``quantkit smoke --tp N`` (a greedy completion and a chat answer from vLLM's server; a failed
   smoke's error in a column of its own), bench/serve_speed.py's measurement in vLLM's Python (offline, CUDA graphs for
   the measured batches: TTFT and decode tok/s at ``--batches``, 1 and 16, and in results.json the limit that the
   serving GPU's memory bandwidth sets, bench/meta.py's ``BANDWIDTH``, none for a GPU it lacks or where nvidia-smi
   lists none), and with two or more sizes ``quantkit eval ARTIFACT --engine vllm`` (``QUANTKIT_VLLM_ARGS`` sets
   vLLM's tensor_parallel_size) on the first ``--eval-tokens`` held-out tokens: perplexity, KLD and top-1 against the
   bf16 source (a failed eval's error in a column of its own, as a smoke's), and the agreement of the sizes (their
   perplexities' ratio, KLD and top-1 differences, whether the greedy completions are identical). The bf16 source is
   served too, at each size (decode tok/s only), for the quantized artifacts' ratio.

Writes ``--results-dir``/{results.json,README.md} (bench/results/MACHINE/70b for the 70B shape alone, else
MACHINE/wide; MACHINE is ``--machine``, else the GPU model nvidia-smi names with xN for N GPUs, as h100 or h200x4,
and h200 where none is visible) after every case, the command and the plan at their head. vLLM's Python:
``--vllm-python`` (else QUANTKIT_VLLM_PYTHON, else ``vllm`` on PATH: quantkit/envs.py), ``--vllm-path DIR`` for a
``pip install --target`` folder put on its PYTHONPATH for serving and smoke, as in scripts/gpu_cases.py (eval takes
a vLLM Python only).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
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
GIB = 2**30
H200_GPU_BYTES = 141_000_000_000  # assumed where no GPU is visible (a plan made elsewhere), and said
# Reference H200 hosts of 1, 2, 4 and 8 GPUs (their GPUs, host memory and disk), to plan for one from elsewhere.
# /dev/shm is taken as half the host memory, Linux's default for a tmpfs; a container may set less (--shm-bytes).
MACHINES = {"h200": (1, 128 * GIB, 64 * GIB), "h200x2": (2, 256 * GIB, 128 * GIB),
            "h200x4": (4, 512 * GIB, 235 * GIB), "h200x8": (8, 560 * GIB, 235 * GIB)}
SERVE_SHARE = 0.85  # vLLM's --gpu-memory-utilization in serve_speed and smoke: a GPU's share must fit in it
AWQ_OVER_GPTQ = 1.8  # AWQ's wall over GPTQ's on the 8B shape, 32 x 2048 tokens (190.8 s / 108.2 s, H200)
VLLM_START_S = 60.0  # vLLM's start, graph capture and measurement beyond loading (32b-8l, batch 1 and 16: 44-72 s)
LOAD_BYTES_S = 1.5e9  # vLLM's load from the page cache
BUILD_BYTES_S = 0.5e9  # drawing random weights and writing them to disk, per bf16 byte
SHM_RESERVE = 5_000_000_000  # compressed-tensors' load_offloaded_model keeps this much of /dev/shm free
EVAL_CPU_FLOPS = 1e12  # float32 FLOP/s of the baseline's forward on the host's cores (an assumption, not measured)
EVAL_HOST_MARGIN = 8_000_000_000  # the eval process itself, its windows and the stored baseline distributions
# The work folder's files beside the source and an output (calibration, tokens, logs, eval reports, the header
# checkpoint) and the file system's own: 1.6 GB on the H100's 32B run (68.5 GB free less the 46.0 GB of source on disk
# left 20.9 GB, not 22.5), the rest for what later cases' logs and reports add.
DISK_MARGIN = 3_000_000_000
SHM = Path("/dev/shm")  # where a one-GPU run puts the source's shards that its disk cannot hold beside an output
PLAN_TOLERANCE = 0.15  # issue 43: the plan must predict the measured peak within 15%
DEFAULT_METHODS = ["gptq", "awq", "fp8-static"]
USES_ARTIFACT = ("smoke", "serve", "eval")  # the case kinds that read quantkit's artifact of their method


@dataclass
class Case:
    """One step: its name, the command it runs, its estimate and the verdict of the plan."""

    name: str
    kind: str  # build | quantize | smoke | serve | eval
    shape: str
    method: str = ""
    tool: str = ""
    tp: int = 1
    estimate_s: float = 0.0
    host_bytes: int = 0
    gpu_bytes: int = 0  # quantize: one GPU's planned peak; serve, smoke, eval: the checkpoint
    disk_bytes: int = 0  # build: the free disk it needs (source, an output, spill, margin); quantize: free_space_asked
    spill_bytes: int = 0  # quantize, --num-gpus 2 or more: what the offloaded load writes to disk beside the output
    shm_bytes: int = 0  # build: the source's first shards placed in /dev/shm (one GPU, a disk too small for it)
    skip: str = ""  # why it does not run ("" = it runs)
    command: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Machine:
    """What the cases must fit in, and how each figure was found (``said``)."""

    name: str
    gpus: int
    gpu_bytes: int  # one GPU's
    host_bytes: int
    disk_bytes: int
    shm_bytes: int
    said: list[str]


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def machine_name(gpus: list[str]) -> str:
    """A machine's name for its results, from nvidia-smi's lines (:func:`meta.gpus`): its GPU model and count (h100,
    h200x4: bench/meta.py's gpu_model), h200 where no GPU is visible (the GPU the plan then assumes)."""
    model = meta.gpu_model(gpus[0]) if gpus else "h200"
    return model if len(gpus) <= 1 else f"{model}x{len(gpus)}"


def machine(args: argparse.Namespace) -> Machine:
    """The machine named by ``--machine``, else this one (nvidia-smi, quantkit's host-memory reading, the free disk
    under the workdir, /dev/shm's size); each figure overridable; this one named by :func:`machine_name`."""
    from quantkit.plan import host_limit

    said: list[str] = []
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.machine:
        gpus, host, disk = MACHINES[args.machine]
        gpu, shm, name = H200_GPU_BYTES, host // 2, args.machine
        given = [f"--{n.replace('_', '-')}" for n in ("gpu_bytes", "host_bytes", "disk_bytes", "shm_bytes")
                 if getattr(args, n)]
        said.append(f"planned for the reference {args.machine} (disk: all of it free; /dev/shm: half the host memory)"
                    + (f", but for {', '.join(given)} as given" if given else ""))
    else:
        totals = meta.gpus()
        gpus = len(totals)
        if totals:
            gpu = int(float(totals[0].split(",")[-1].split()[0]) * 2**20)  # "NVIDIA H200, 143771 MiB"
        else:
            gpu, gpus = H200_GPU_BYTES, 1
            said.append("no GPU visible: " + ("planned for the GPU memory given" if args.gpu_bytes
                                              else f"planned for an H200's {gb(gpu)}"))
        host = (host_limit() or (0, ""))[0]
        disk = shutil.disk_usage(args.workdir).free
        shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else host
        name = machine_name(totals)
    return Machine(name, args.gpus or gpus, args.gpu_bytes or gpu, args.host_bytes or host,
                   args.disk_bytes or disk, args.shm_bytes or shm, said)


def recipe_output(method: str) -> dict[str, Any]:
    """A recipe's output entry for one of bench/quantize_cost.py's methods (its verb, its flags as fields)."""
    verb, flags = quantize_cost.METHODS[method]
    return {"method": verb, **{flags[k][2:].replace("-", "_"): flags[k + 1] for k in range(0, len(flags), 2)}}


def header_checkpoint(shape: str, folder: Path) -> Path:
    """bench/header_only.py's checkpoint of ``shape``, reused when one of the same config is there."""
    if (folder / "model.safetensors.index.json").exists() and \
            json.loads((folder / "config.json").read_text()) == header_only.config(shape):
        return folder
    return header_only.write(shape, folder)


def plan_outputs(shape: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """quantkit's own plan of each method for a header-only checkpoint of ``shape`` (one ``quantkit run --dry-run``
    with an output per method, so one process): its plan by method, with the source's size and parameters."""
    hdr = header_checkpoint(shape, args.workdir / f"header-{shape}")
    recipe = {"model": {"source": str(hdr)}, "runtime": {"device": args.device, "num_gpus": args.num_gpus},
              "calibration": {"samples": args.samples, "seq_len": args.seq_len},
              "outputs": [recipe_output(m) for m in args.methods]}
    path = args.workdir / f"plan-{shape}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    argv = [sys.executable, "-m", "quantkit", "run", str(path), "--output", str(args.workdir / "planned"),
            "--dry-run", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=meta.ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise SystemExit(f"quantkit's plan of {shape} failed: {proc.stderr.strip()[-500:]}")
    plan = json.loads(proc.stdout)
    return {method: {**out, "source_bytes": plan["source"]["size_bytes"], "parameters": plan["source"]["parameters"]}
            for method, out in zip(args.methods, plan["outputs"])}


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


def spill_bytes(source: int, args: argparse.Namespace, m: Machine) -> int:
    """What llm-compressor's offloaded load (``--num-gpus`` 2 or more) writes to disk: the model beyond /dev/shm."""
    return max(0, source - max(m.shm_bytes - SHM_RESERVE, 0)) if args.num_gpus > 1 else 0


def eval_estimate(source: int, parameters: int, artifact: int, tokens: int) -> float:
    """``quantkit eval`` of one artifact: the baseline loaded and scored in float32 on the host, then vLLM."""
    return source / 1e9 + 2 * parameters * tokens / EVAL_CPU_FLOPS + VLLM_START_S + artifact / LOAD_BYTES_S


def shm_folder(src: Path) -> Path:
    """Where ``build`` puts the source's shards that go to /dev/shm (the source folder links to them): one folder per
    source folder, so two work folders never share one."""
    return SHM / f"quantkit-bench-{hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]}-{src.name}"


def built(src: Path) -> bool:
    """Whether a source is there to reuse: its stamp, and every shard readable (a link into a /dev/shm that was
    emptied since is not)."""
    return (src / "bench-config.json").exists() and all(f.exists() for f in src.glob("model-*.safetensors"))


def in_shm(src: Path) -> int:
    """Bytes of a built source that live in /dev/shm (its linked shards): host memory they hold."""
    return sum(f.stat().st_size for f in src.glob("model-*.safetensors") if f.is_symlink()) if built(src) else 0


def shm_shards(over: int, sizes: list[int]) -> tuple[int, int]:
    """How many of the source's first shards, and their bytes, take at least ``over`` bytes off the disk."""
    count = total = 0
    for size in sizes:
        if total >= over:
            break
        count, total = count + 1, total + size
    return count, total


def shape_cases(shape: str, args: argparse.Namespace, m: Machine) -> tuple[Case, list[Case]]:
    """The build and, in the order they run, every case of one shape with its plan figures (no verdicts yet).

    On one GPU, a disk that cannot hold the source beside an output takes the source's first shards off it into
    /dev/shm, if /dev/shm (less ``SHM_RESERVE``) holds them: host memory they hold while every case runs, which the
    verdicts subtract from the machine's. A multi-GPU run's offloaded load has /dev/shm for itself. An output's disk
    figure is what quantkit's free-space check asks for it (quantkit/artifact.py's ``free_space_asked``), the direct
    output's too."""
    from quantkit.artifact import free_space_asked

    plans = plan_outputs(shape, args)
    first = next(iter(plans.values()))
    source, parameters = first["source_bytes"], first["parameters"]
    largest = max(free_space_asked(p["disk_bytes"]) for p in plans.values())
    src = args.workdir / f"src-{shape}"
    done = built(src)
    spill = spill_bytes(source, args, m)
    disk = (0 if done else source) + largest + spill + DISK_MARGIN
    count, shm = 0, in_shm(src)
    if not done and disk > m.disk_bytes and args.num_gpus == 1:
        sizes = [f.stat().st_size for f in sorted((args.workdir / f"header-{shape}").glob("model-*.safetensors"))]
        count, shm = shm_shards(disk - m.disk_bytes, sizes)
        if shm < disk - m.disk_bytes or shm > m.shm_bytes - SHM_RESERVE:
            count, shm = 0, 0  # the whole source is not enough, or /dev/shm cannot take it: the disk's verdict stands
    build = Case(f"{shape}/build", "build", shape, estimate_s=source / BUILD_BYTES_S,
                 disk_bytes=disk - (0 if done else shm), shm_bytes=shm,
                 command=[sys.executable, str(BENCH / "wide.py"), "--build", shape, str(src),
                          *([str(count)] if count else [])])
    tools = sorted(args.tools, key=lambda t: t == "quantkit")  # the direct output is deleted before quantkit's
    todo: list[Case] = []
    for method in args.methods:
        p = plans[method]
        for tool in tools:
            todo.append(Case(f"{shape}/{method}/{tool}", "quantize", shape, method, tool,
                             estimate_s=quantize_estimate(shape, method, args.samples, args.seq_len) * args.repeat,
                             host_bytes=p["host_bytes"], gpu_bytes=p["gpu_bytes"],
                             disk_bytes=free_space_asked(p["disk_bytes"]), spill_bytes=spill))
        if not args.serve:
            continue
        size = p["disk_bytes"]
        for tp in args.tp:
            start = VLLM_START_S + size / LOAD_BYTES_S
            todo.append(Case(f"{shape}/{method}/smoke-tp{tp}", "smoke", shape, method, tp=tp, estimate_s=start,
                             gpu_bytes=size))
            todo.append(Case(f"{shape}/{method}/serve-tp{tp}", "serve", shape, method, tp=tp, estimate_s=start,
                             gpu_bytes=size))
        if len(args.tp) > 1:
            for tp in args.tp:
                todo.append(Case(f"{shape}/{method}/eval-tp{tp}", "eval", shape, method, tp=tp,
                                 estimate_s=eval_estimate(source, parameters, size, args.eval_tokens),
                                 host_bytes=4 * parameters + EVAL_HOST_MARGIN, gpu_bytes=size))
    if args.serve:
        todo += [Case(f"{shape}/bf16/serve-tp{tp}", "serve", shape, tp=tp, estimate_s=VLLM_START_S + source /
                      LOAD_BYTES_S, gpu_bytes=source) for tp in args.tp]
    return build, todo


def verdict(c: Case, build: Case, made: set[str], args: argparse.Namespace, m: Machine) -> str:
    """Why ``c`` cannot run on ``m`` ("" when it can): its own needs first, then what it depends on. A quantize
    case's disk is checked here where the source is built already (the free disk is then the outputs'); else the
    build's verdict has checked the largest output beside the source it writes. The source's shards in /dev/shm are
    taken off the host memory: no case's figure counts them (a quantize process's is what it holds of its own beside
    the source's pages it maps: FP8 static of the 32B on the H100, the whole source in /dev/shm, 30.5 GiB allocated
    beside it; eval's float32 baseline is a copy)."""
    if c.kind == "build":
        return ""
    held = build.shm_bytes
    host = m.host_bytes - held
    beside = f" beside the source's {gb(held)} in /dev/shm" if held else ""
    if c.kind == "quantize":
        if args.num_gpus > m.gpus:
            return f"GPUs: --num-gpus {args.num_gpus}, the machine has {m.gpus}"
        if c.host_bytes > host:
            way = " (--num-gpus 2 or more spills to disk what /dev/shm cannot hold)" \
                if args.num_gpus == 1 and m.gpus > 1 else ""
            return f"host memory: the plan's floor is {gb(c.host_bytes)}, the machine allows {gb(host)}{beside}{way}"
        if c.gpu_bytes > m.gpu_bytes:
            return f"GPU memory: the plan's peak is {gb(c.gpu_bytes)}, one GPU has {gb(m.gpu_bytes)}"
    else:
        if c.tp > m.gpus:
            return f"GPUs: tp {c.tp}, the machine has {m.gpus}"
        if c.gpu_bytes / c.tp > SERVE_SHARE * m.gpu_bytes:
            return (f"GPU memory: the {gb(c.gpu_bytes)} checkpoint's 1/{c.tp} exceeds vLLM's {SERVE_SHARE:.0%} of "
                    f"{gb(m.gpu_bytes)}")
        if c.kind == "eval" and c.host_bytes > host:
            return (f"host memory: quantkit eval's baseline in float32 on the host needs {gb(c.host_bytes)}, the "
                    f"machine allows {gb(host)}{beside}")
    if build.skip and not build.skip.startswith("the source is already"):
        return f"no source ({build.name} is skipped)"
    need = c.disk_bytes + c.spill_bytes + DISK_MARGIN  # quantize: the free disk its output needs
    if c.kind == "quantize" and need > m.disk_bytes and built(args.workdir / f"src-{c.shape}"):
        spill = f", {gb(c.spill_bytes)} the offloaded load spills" if c.spill_bytes else ""
        return (f"disk: the output needs {gb(need)} free beside the built source ({gb(c.disk_bytes)} that quantkit's "
                f"free-space check asks for it{spill}, {gb(DISK_MARGIN)} for the work folder's other files), "
                f"{args.workdir} has {gb(m.disk_bytes)} free")
    if c.method and c.kind in USES_ARTIFACT and c.method not in made:
        return "quantkit's artifact of it is not made in this run"
    return ""


def cases(args: argparse.Namespace, m: Machine) -> list[Case]:
    """Every case in order, each with its estimate and whether it fits; ``--only`` and the budget applied."""
    out: list[Case] = []
    left = args.budget_s
    wanted = lambda name: not args.only or any(fnmatch.fnmatch(name, p) for p in args.only)  # noqa: E731
    for shape in args.shapes:
        build, todo = shape_cases(shape, args, m)
        needed = [c for c in todo if wanted(c.name)]
        done = built(args.workdir / f"src-{shape}")
        if needed and not wanted(build.name) and done:
            build.skip = "the source is already built (--only left it out)"
        elif not needed and not wanted(build.name):
            continue
        elif not done and build.disk_bytes > m.disk_bytes:  # a built one: each case's verdict checks its output
            source = build.disk_bytes - max(c.disk_bytes for c in todo if c.kind == "quantize") - DISK_MARGIN
            lacks = build.disk_bytes - m.disk_bytes
            shm = f", and /dev/shm less its reserve ({gb(m.shm_bytes - SHM_RESERVE)}) cannot take the {gb(lacks)} " \
                "of the source it lacks" if args.num_gpus == 1 and lacks <= source else ""
            fewer = f" (its width with fewer layers: {', '.join(shallower(shape))})" if shallower(shape) else ""
            build.skip = (f"disk: the source and one output at a time need {gb(build.disk_bytes)} ({gb(source)} of "
                          f"it the source and what the offloaded load spills), {args.workdir} has "
                          f"{gb(m.disk_bytes)} free{shm}{fewer}")
        made: set[str] = set()
        for c in [build, *needed]:
            c.skip = c.skip or verdict(c, build, made, args, m)
            if not c.skip and left is not None and c.estimate_s > left:
                c.skip = f"budget: estimated {c.estimate_s:.0f} s, {max(left, 0):.0f} s of --budget-s left"
            if not c.skip and left is not None:
                left -= c.estimate_s
            if not c.skip and c.kind == "quantize" and c.tool == "quantkit":
                made.add(c.method)
            out.append(c)
        if not build.skip and all(c.skip for c in needed) and not (args.only and wanted(build.name)):
            build.skip = "none of its cases runs"
            left = None if left is None else left + build.estimate_s
    return out


# ----------------------------------------------------------------------------------------------------------------
# Running


def build(shape: str, folder: Path, shards_in_shm: int = 0) -> None:
    """A random bf16 checkpoint of ``shape``, written one tensor at a time into 5 GB shards (normal with std 0.02,
    transformers' initializer range; norms one and biases zero, as transformers initialises them), drawn on the GPU
    where there is one; the reference model's tokenizer. Reused when one with the same config is there. The first
    ``shards_in_shm`` shards are written to /dev/shm (``shm_folder``) and linked from ``folder``: the plan's way to fit
    a source that the disk cannot hold beside an output. They stay there for the next run to reuse, holding that
    much host memory, until removed."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = header_only.config(shape)
    stamp = folder / "bench-config.json"
    if built(folder) and json.loads(stamp.read_text()) == cfg:
        return
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(shm_folder(folder), ignore_errors=True)
    folder.mkdir(parents=True)
    if shards_in_shm:
        shm_folder(folder).mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    groups: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, (_, dims) in header_only.tensors(shape).items():
        n = 2 * header_only._numel(dims)
        if groups[-1] and size + n > header_only.SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, dims))
        size += n
    weight_map, total = {}, 0
    for k, group in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name, dims in group:
            if name.endswith(".bias"):
                t = torch.zeros(dims, dtype=torch.bfloat16)
            elif len(dims) == 1:
                t = torch.ones(dims, dtype=torch.bfloat16)
            else:
                t = (torch.randn(dims, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).cpu()
            shard[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        if k <= shards_in_shm:
            save_file(shard, str(shm_folder(folder) / file), metadata={"format": "pt"})
            (folder / file).symlink_to(shm_folder(folder) / file)
        else:
            save_file(shard, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    transformers.AutoTokenizer.from_pretrained(header_only.TINY).save_pretrained(str(folder))
    shutil.copy(header_only.TINY / "generation_config.json", folder / "generation_config.json")
    stamp.write_text(json.dumps(cfg))


class HostSampler(threading.Thread):
    """The machine's used memory (MemTotal - MemAvailable) above its level at start, sampled every 0.5 s: what a job
    takes from the host, counting the /dev/shm copy that a distributed run's ranks share once (their summed RSS
    counts it once per rank) and leaving out the page cache of the checkpoint read."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.start_used = self.peak_used = self._used()

    @staticmethod
    def _used() -> int:
        info = {k: int(v.split()[0]) * 1024 for k, v in
                (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines() if ":" in ln)}
        return info["MemTotal"] - info["MemAvailable"]

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.peak_used = max(self.peak_used, self._used())

    def peak(self) -> int:
        return self.peak_used - self.start_used


def quantize_command(c: Case, args: argparse.Namespace, inputs: dict[str, Path], peak: Path) -> list[str]:
    """The timed process: quantkit's CLI or the direct script (under torchrun for ``--num-gpus`` 2 or more), under
    bench/cuda_peak.py."""
    out = args.workdir / f"out-{c.shape}-{c.method}-{c.tool}"
    head = [sys.executable, str(BENCH / "cuda_peak.py"), str(peak)]
    if c.tool == "quantkit":
        verb, flags = quantize_cost.METHODS[c.method]
        gpus = ["--num-gpus", str(args.num_gpus)] if args.num_gpus > 1 else []
        return head + ["-m", "quantkit", verb, str(inputs["src"]), str(out), *flags, "--calib", str(inputs["calib"]),
                       "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--device", args.device,
                       *gpus, "--force", "--json"]
    ddp = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.num_gpus}"] \
        if args.num_gpus > 1 else []
    return head + ddp + [str(BENCH / "quantize_cost.py"), "--direct", c.method, str(inputs["src"]), str(out),
                         str(inputs["tokens"])]


def plan_check(planned: int, measured: int | None) -> dict[str, Any]:
    """One figure of the plan against its measurement: the error and whether it is within ``PLAN_TOLERANCE``."""
    if not measured:
        return {"planned": planned, "measured": measured, "error": None, "within": None}
    error = planned / measured - 1
    return {"planned": planned, "measured": measured, "error": round(error, 4),
            "within": abs(error) <= PLAN_TOLERANCE}


TRACEBACK = "Traceback (most recent call last):"
LAUNCHER_ERRORS = ("ChildFailedError",)  # torchrun's, after its ranks' tracebacks: it says a rank failed, not why


def failure_line(log: str) -> str:
    """The one line of a failed process's log that says why it failed (its error in results.json and the README;
    at most 300 characters). Not the log's last line: quantkit prints its ``error:`` line and then a hint under it,
    and a Python program may print after its traceback (an atexit handler, torchrun's report of its ranks). So the
    last of quantkit's ``error:`` lines and of the tracebacks' exception lines (the first line under a traceback's
    indented frames; torchrun's ChildFailedError passed over where a rank's own traceback is there), whichever came
    later; else the last non-empty line (``SystemExit("...")`` prints its message alone)."""
    lines = log.splitlines()
    said = [(k, ln) for k, ln in enumerate(lines) if ln.startswith("error: ")]
    raised: list[tuple[int, str]] = []
    for k, ln in enumerate(lines):
        if ln.strip() != TRACEBACK:
            continue
        end = next((j for j in range(k + 1, len(lines)) if lines[j].strip() and not lines[j][0].isspace()), None)
        if end is not None:
            raised.append((end, lines[end]))
    launcher = [r for r in raised if r[1].split(":", 1)[0].rsplit(".", 1)[-1] in LAUNCHER_ERRORS]
    found = said + ([r for r in raised if r not in launcher] or launcher)
    if found:
        return max(found)[1].strip()[:300]
    tail = [ln for ln in lines if ln.strip()]
    return tail[-1].strip()[:300] if tail else ""


def run_quantize(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """``--repeat`` runs of one case (the median kept, every wall beside it), each that finished (rc 0) checked
    against the plan, each that failed given its log's :func:`failure_line` as its error; the direct output deleted
    after."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "LLM_COMPRESSOR_LOG_LEVEL": os.environ.get("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")}
    out = args.workdir / f"out-{c.shape}-{c.method}-{c.tool}"
    tries = []
    for k in range(args.repeat):
        peak = args.workdir / f"peak-{c.shape}-{c.method}-{c.tool}-{k}.json"
        shutil.rmtree(out, ignore_errors=True)
        host = HostSampler()
        host.start()
        r = quantize_cost.measure(quantize_command(c, args, inputs, peak), args.logs / f"{c.name.replace('/', '-')}"
                                  f"-{k}.log", env)
        host.stop.set()
        host.join()
        r.update(quantize_cost.reported(c.tool, r.pop("stdout"), r["rc"]))
        r["peak_host_used_bytes"] = host.peak()
        r.update(json.loads(peak.read_text()) if peak.exists() else {})
        r["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.exists() else 0
        per_gpu = r.get("peak_gpu_bytes_per_gpu") or []
        if r["rc"]:  # a failed run's peaks are not the work the plan is of (refused in 1.4 s: "+58850%")
            r["error"] = failure_line(Path(r["log"]).read_text(errors="replace"))
        else:
            r["plan"] = {"gpu": plan_check(c.gpu_bytes, max(per_gpu, default=None) or r.get("peak_gpu_bytes")),
                         "host": plan_check(c.host_bytes, r["peak_host_used_bytes"])}
        tries.append(r)
    if c.tool != "quantkit":  # quantkit's is deleted after the last case that reads it (last_users)
        shutil.rmtree(out, ignore_errors=True)
    return quantize_cost.median_run(tries)


def artifact(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> Path:
    return inputs["src"] if not c.method else args.workdir / f"out-{c.shape}-{c.method}-quantkit"


def absent(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any] | None:
    """The result of a smoke, serve or eval case whose checkpoint is not there (None when it is): its quantization or
    the build failed, which is said and the case passed over, so the cases after it still run (a serve case's reader
    raised instead and ended the script)."""
    folder = artifact(c, args, inputs)
    if (folder / "config.json").exists():
        return None
    return {"rc": None, "error": f"{folder} is not there ({'its quantization' if c.method else 'the build'} failed)"}


def run_serve(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """bench/serve_speed.py's measurement of one checkpoint on ``c.tp`` GPUs, its decode limit against the serving
    GPU's bandwidth (serve_speed's ``limit_bandwidth``: none for a GPU its table lacks, or where no GPU is seen)."""
    if (gone := absent(c, args, inputs)) is not None:
        return gone
    import serve_speed

    ns = argparse.Namespace(python=args.vllm_python, vllm_path=args.vllm_path, kernels=False,
                            batches=args.batches, prompt_len=512, gen=128, max_model_len=2048, capture_all=False,
                            logs=args.logs, timeout=1800.0, bandwidth=None)
    return serve_speed.run_one(artifact(c, args, inputs), ns, tp=c.tp)


def engine_command(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> list[str]:
    """``quantkit smoke --tp N`` or ``quantkit eval --engine vllm`` of quantkit's artifact."""
    art = str(artifact(c, args, inputs))
    python = ["--python", args.vllm_python] if args.vllm_python else []
    if c.kind == "smoke":
        env = ["--env", f"PYTHONPATH={args.vllm_path}"] if args.vllm_path else []
        return [sys.executable, "-m", "quantkit", "smoke", art, "--engine", "vllm", "--tp", str(c.tp), *python, *env,
                "--gpu-memory-utilization", str(SERVE_SHARE), "--max-model-len", "2048", "--timeout", "1800",
                "--log-dir", str(args.logs), "--json"]
    return [sys.executable, "-m", "quantkit", "eval", art, "--engine", "vllm", "--baseline", str(inputs["src"]),
            "--device", "cpu", "--ctx", str(min(2048, args.eval_tokens)), "--max-tokens", str(args.eval_tokens),
            *python, "--report-dir", str(args.workdir / f"eval-{c.shape}-{c.method}-tp{c.tp}"), "--json"]


def run_engine(c: Case, args: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """A smoke or eval case: its exit code, wall and the figures its JSON gives (the greedy completion; ppl, KLD,
    top-1) and its error (a failed eval's is its JSON's, ``ok: false``; a smoke's is its run's, or its JSON's where
    quantkit refused before any run), the whole JSON beside them."""
    if (gone := absent(c, args, inputs)) is not None:
        return gone
    env = {**os.environ, "QUANTKIT_VLLM_ARGS": json.dumps({"tensor_parallel_size": c.tp,
                                                          "gpu_memory_utilization": SERVE_SHARE})}
    log = args.logs / f"{c.name.replace('/', '-')}.log"
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run(engine_command(c, args, inputs), stdout=subprocess.PIPE, stderr=err, text=True,
                              cwd=meta.ROOT, env=env)
    r: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "log": str(log)}
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {**r, "error": failure_line(log.read_text(errors="replace")) or "no JSON on stdout"}
    if c.kind == "smoke":
        run = (doc.get("runs") or [{}])[0]
        return {**r, "ok": doc.get("ok"), "completion": (run.get("completion") or {}).get("text"),
                "chat": (run.get("chat") or {}).get("text"), "error": run.get("error") or doc.get("error"),
                "smoke": doc}
    res = (doc.get("results") or [{}])[0]
    return {**r, **{k: res.get(k) for k in ("ppl", "kld", "top1", "ppl_ratio")},
            "baseline_ppl": (doc.get("baseline") or {}).get("ppl"), "error": doc.get("error"), "eval": doc}


def build_failed(build: Case, all_cases: list[Case]) -> list[Case]:
    """After ``build`` failed (rc != 0), every case of its shape still to run is skipped, each in one line with the
    rc: they ran against a missing source and failed one by one. The next shape's cases are left as they are. Returns
    the cases it skipped."""
    skipped = [c for c in all_cases if c.shape == build.shape and c is not build and not c.skip]
    for c in skipped:
        c.skip = f"{build.name} failed (rc {build.result['rc']}): no source"
    return skipped


def last_users(all_cases: list[Case]) -> dict[tuple[str, str], str]:
    """The name of the last running case that reads each quantkit artifact: it is deleted after that one."""
    last = {}
    for c in all_cases:
        if not c.skip and c.method and (c.kind in USES_ARTIFACT or (c.kind == "quantize" and c.tool == "quantkit")):
            last[(c.shape, c.method)] = c.name
    return last


# ----------------------------------------------------------------------------------------------------------------
# Results


def plan_text(all_cases: list[Case], m: Machine, args: argparse.Namespace) -> str:
    lines = [f"machine {m.name}: {m.gpus} GPU(s) of {gb(m.gpu_bytes)}, host memory {gb(m.host_bytes)}, /dev/shm "
             f"{gb(m.shm_bytes)}, free disk under {args.workdir} {gb(m.disk_bytes)}"
             + "".join(f"; {s}" for s in m.said),
             f"calibration {args.samples} x {args.seq_len} tokens on {args.num_gpus} GPU(s), {args.repeat} run(s) per "
             f"tool; tp {', '.join(map(str, args.tp))}; budget "
             + (f"{args.budget_s:.0f} s" if args.budget_s is not None else "none")]
    for c in all_cases:
        mem = (f"host {gb(c.host_bytes)}, GPU {gb(c.gpu_bytes)}, disk {gb(c.disk_bytes)}" if c.kind == "quantize" else
               f"checkpoint {gb(c.gpu_bytes)}" + (f", host {gb(c.host_bytes)}" if c.host_bytes else "")
               if c.kind != "build" else f"disk {gb(c.disk_bytes)}"
               + (f" and {gb(c.shm_bytes)} in {shm_folder(args.workdir / f'src-{c.shape}')}" if c.shm_bytes else ""))
        lines.append(f"  {'skip' if c.skip else 'run '} {c.name:<34} {mem}, ~{c.estimate_s:.0f} s"
                     + (f": {c.skip}" if c.skip else ""))
    run = [c for c in all_cases if not c.skip]
    lines.append(f"{len(run)} of {len(all_cases)} cases run, about {sum(c.estimate_s for c in run) / 60:.1f} min")
    return "\n".join(lines)


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def check_cell(p: dict[str, Any] | None) -> str:
    if not p or p.get("error") is None:
        return "-"
    return f"{gib(p['planned'])} ({p['error']:+.0%}, {'within' if p['within'] else 'OUTSIDE'} 15%)"


def text_cell(text: str | None, cut: int | None = 80) -> str:
    """A table cell of text a process gave (a completion, an error): quoted, so that a "|" or a newline in it does not
    break the table, and cut at ``cut`` characters; "-" for none."""
    return f"`{text[:cut]!r}`" if text else "-"


def smoke_row(c: dict[str, Any]) -> str:
    """A smoke case's row: its rc ("-" for one that never ran: its checkpoint was missing), the first 80 characters of
    its greedy completion and chat answer and, in its own column and whole (at most 300 characters: ``run_engine``),
    its error: a missing checkpoint's was shown as the chat answer, its reason cut off."""
    r = c["result"]
    rc = "-" if r.get("rc") is None else r["rc"]
    return (f"| {c['name']} | {rc} | {text_cell(r.get('completion'))} | {text_cell(r.get('chat'))} | "
            f"{text_cell(r.get('error'), None)} |")


def eval_row(c: dict[str, Any]) -> str:
    """An eval case's row: its rc ("-" for one that never ran), perplexity, KLD and top-1 and, in its own column as
    the smoke table's, its error: a failed eval showed its rc and dashes alone. The error is the result's, else that
    of quantkit eval's JSON (``ok: false``; results.json written before the result carried it has it there only)."""
    r = c["result"]
    rc = "-" if r.get("rc") is None else r["rc"]
    error = r.get("error") or (r.get("eval") or {}).get("error")
    return (f"| {c['name']} | {rc} | {r.get('ppl') or '-'} | {r.get('kld') or '-'} | {r.get('top1') or '-'} | "
            f"{text_cell(error, None)} |")


def agreement(data: dict[str, Any]) -> list[str]:
    """Each method's eval and smoke at its tp sizes, against those at the first size."""
    rows = []
    by = {(c["shape"], c["method"], c["kind"], c["tp"]): c["result"] for c in data["cases"] if c["result"]}
    for (shape, method, kind, tp), r in by.items():
        if kind != "eval" or tp == data["tp"][0] or r.get("ppl") is None:
            continue
        ref = by.get((shape, method, "eval", data["tp"][0])) or {}
        if ref.get("ppl") is None:
            continue
        s0 = (by.get((shape, method, "smoke", data["tp"][0])) or {}).get("completion")
        s1 = (by.get((shape, method, "smoke", tp)) or {}).get("completion")
        same = "-" if s0 is None or s1 is None else "yes" if s0 == s1 else "no"
        rows.append(f"| {shape} {method} | tp {data['tp'][0]} / tp {tp} | {ref['ppl']:.4f} / {r['ppl']:.4f} "
                    f"({r['ppl'] / ref['ppl'] - 1:+.2%}) | {ref['kld']:.5f} / {r['kld']:.5f} | "
                    f"{ref['top1']:.4f} / {r['top1']:.4f} | {same} |")
    return rows


def readme(data: dict[str, Any]) -> str:
    lines = [f"# {', '.join(data['shapes'])} on {data['machine_name']}: quantize, serve, eval (bench/wide.py)", "",
             meta.md_header(data),
             "Written by bench/wide.py (its docstring says what each figure is). The plan it printed first:", "",
             "```", data["plan"], "```", "",
             "| case | rc | wall (runs) | its steps (s) | peak GPU, all / largest one (nvidia-smi) | torch max allocated "
             "| peak host used (RSS of the tree, anon) | plan: GPU | plan: host | output |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in data["cases"]:
        r = c["result"]
        if c["kind"] != "quantize" or not r:
            continue
        walls = r.get("walls_s") or [r["wall_s"]]
        one = max(r.get("peak_gpu_bytes_per_gpu") or [0]) or None
        lines.append(f"| {c['name']} | {r['rc']} | {r['wall_s']:.1f} s ({', '.join(f'{w:.0f}' for w in walls)}) | "
                     f"{quantize_cost.steps(r) or '-'} | {gib(r.get('peak_gpu_bytes'))} / {gib(one)} | "
                     f"{gib(r.get('max_memory_allocated'))} | "
                     f"{gib(r.get('peak_host_used_bytes'))} ({gib(r.get('peak_rss_bytes'))}, "
                     f"{gib(r.get('peak_anon_rss_bytes'))}) | {check_cell((r.get('plan') or {}).get('gpu'))} | "
                     f"{check_cell((r.get('plan') or {}).get('host'))} | {r.get('output_bytes', 0) / 1e9:.1f} GB |")
    batches = data["batches"]
    served = [c for c in data["cases"] if c["kind"] == "serve" and c["result"]]
    if served:
        lines += ["", "| served | tp | kernel | TTFT | " + " | ".join(f"decode tok/s b{b}" for b in batches) + " |",
                  "|---|---|---|---|" + "---|" * len(batches)]
    for c in served:
        r = c["result"]
        cells = [f"{r[f'b{b}']['decode_tok_s']:.0f}" if r.get(f"b{b}") else "-" for b in batches]
        ttft = f"{r['ttft_s'] * 1000:.0f} ms" if r.get("ttft_s") else f"`{(r.get('error') or '')[:120]}`"
        lines.append(f"| {c['name']} | {c['tp']} | {'; '.join(r.get('kernels') or []) or '-'} | {ttft} | "
                     + " | ".join(cells) + " |")
    smoked = [c for c in data["cases"] if c["kind"] == "smoke" and c["result"]]
    if smoked:
        lines += ["", "| smoke | rc | greedy completion | chat answer | error |", "|---|---|---|---|---|"]
        lines += [smoke_row(c) for c in smoked]
    evals = [c for c in data["cases"] if c["kind"] == "eval" and c["result"]]
    if evals:
        lines += ["", f"`quantkit eval --engine vllm` on {data['eval_tokens']} held-out tokens against the bf16 source "
                  "(scored in transformers on the host):", "", "| eval | rc | ppl | KLD | top-1 | error |",
                  "|---|---|---|---|---|---|"]
        lines += [eval_row(c) for c in evals]
        rows = agreement(data)
        if rows:
            lines += ["", "| agreement | tp | ppl | KLD | top-1 | same greedy completion |",
                      "|---|---|---|---|---|---|", *rows]
    skipped = [f"- {c['name']}: {c['skip']}" for c in data["cases"] if c["skip"]]
    if skipped:
        lines += ["", "Skipped before starting:", "", *skipped]
    return "\n".join(lines) + "\n"


def save(data: dict[str, Any], all_cases: list[Case], folder: Path) -> None:
    data["cases"] = [asdict(c) for c in all_cases]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (folder / "README.md").write_text(readme(data))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ints = lambda s: [int(x) for x in split(s)]  # noqa: E731
    ap.add_argument("--shapes", type=split, default=["32b", "qwen3-30b-a3b"], help="bench/shapes.py names")
    ap.add_argument("--methods", type=split, default=DEFAULT_METHODS, help="from bench/quantize_cost.py's")
    ap.add_argument("--tools", type=split, default=["quantkit", "llm-compressor"])
    ap.add_argument("--only", type=split, default=[], help="case names or shell patterns, comma-separated")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1, help="runs per method and tool (the median is kept)")
    ap.add_argument("--num-gpus", type=int, default=1, help="GPUs the calibration is spread over (quantkit's "
                                                            "--num-gpus; llm-compressor's DDP example)")
    ap.add_argument("--tp", type=ints, help="tensor-parallel sizes to serve at, the first the main one; two or more "
                                            "add quantkit eval at each [default: --num-gpus]")
    ap.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens quantkit eval scores")
    ap.add_argument("--budget-s", type=float, help="skip a case whose estimate exceeds what is left of this")
    ap.add_argument("--device", default="cuda", help="quantkit's --device (cpu: a logic check of this script)")
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="quantize only")
    ap.add_argument("--batches", type=ints, default=[1, 16])
    ap.add_argument("--vllm-python", help="vLLM's Python [default: quantkit's rule, quantkit/envs.py]")
    ap.add_argument("--vllm-path", help="a pip install --target folder put on vLLM's PYTHONPATH")
    ap.add_argument("--machine", choices=list(MACHINES), help="plan for this reference machine, not the one running")
    ap.add_argument("--gpus", type=int, help="plan for this many GPUs [default: nvidia-smi's count]")
    ap.add_argument("--gpu-bytes", type=float, help="plan for this much memory per GPU [default: nvidia-smi's]")
    ap.add_argument("--host-bytes", type=float, help="plan for this much host memory [default: quantkit's reading]")
    ap.add_argument("--disk-bytes", type=float, help="plan for this much free disk [default: under --workdir]")
    ap.add_argument("--shm-bytes", type=float, help="plan for a /dev/shm of this size [default: its size here]")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-wide"))
    ap.add_argument("--results-dir", type=Path, help="[default: bench/results/MACHINE/70b for the 70B shape alone, "
                                                     "else bench/results/MACHINE/wide]")
    ap.add_argument("--logs", type=Path, help="[default: WORKDIR/logs]")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and every command; run nothing")
    args = ap.parse_args(argv)
    bad = [s for s in args.shapes if s not in BUILDABLE] + [x for x in args.methods if x not in quantize_cost.METHODS] \
        + [t for t in args.tools if t not in ("quantkit", "llm-compressor")]
    if bad:
        ap.error(f"unknown shape, method or tool: {', '.join(bad)}")
    args.tp = args.tp or [args.num_gpus]
    args.logs = args.logs or args.workdir / "logs"
    for name in ("gpu_bytes", "host_bytes", "disk_bytes", "shm_bytes"):
        setattr(args, name, None if getattr(args, name) is None else int(getattr(args, name)))
    return args


def main() -> None:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--build":  # the build case's process: SHAPE FOLDER [SHM_SHARDS]
        build(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) == 5 else 0)
        return
    args = parse()
    m = machine(args)
    args.results_dir = args.results_dir or meta.RESULTS / m.name / ("70b" if args.shapes == ["70b"] else "wide")
    all_cases = cases(args, m)
    plan = plan_text(all_cases, m, args)
    print(plan, flush=True)
    inputs_of = lambda shape: {"src": args.workdir / f"src-{shape}", "calib": args.workdir / "calib.jsonl.gz",  # noqa
                               "tokens": args.workdir / "tokens.json"}
    if args.dry_run:
        for c in all_cases:
            if c.kind == "quantize":
                c.command = quantize_command(c, args, inputs_of(c.shape), args.workdir / "peak.json")
            elif c.kind in ("smoke", "eval"):
                c.command = engine_command(c, args, inputs_of(c.shape))
            if not c.skip:
                print(f"{c.name}: " + (shlex.join(c.command) if c.command else
                                       f"bench/serve_speed.py's run_one(tp={c.tp}) in "
                                       f"{args.vllm_python or 'vLLM'}'s Python"))
        return
    if any(c.kind in USES_ARTIFACT and not c.skip for c in all_cases):
        from quantkit.engines import registry
        from quantkit.formats.names import VLLM

        args.vllm_python = registry.get(VLLM).find_python(args.vllm_python).python
    args.logs.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {**meta.header(), "plan": plan, "machine_name": m.name, "shapes": args.shapes,
                            "samples": args.samples, "seq_len": args.seq_len, "num_gpus": args.num_gpus,
                            "tp": args.tp, "batches": args.batches, "eval_tokens": args.eval_tokens}
    last = last_users(all_cases)
    for c in all_cases:
        if c.skip:
            continue
        print(f"== {c.name}", flush=True)
        inputs = inputs_of(c.shape)
        t0 = time.perf_counter()
        if c.kind == "build":
            proc = subprocess.run(c.command, cwd=meta.ROOT)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(inputs["src"]) if proc.returncode == 0 else None
            if tok is not None:
                quantize_cost.make_calibration(inputs["calib"], args.samples, args.seq_len, tok)
                samples, sha = quantize_cost.calibration_tokens(inputs["calib"], args.samples, args.seq_len, tok)
                inputs["tokens"].write_text(json.dumps(samples))
                data.setdefault("tokens_sha256", {})[c.shape] = sha
            c.result = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
            if proc.returncode:
                print(f"   {c.name} failed (rc {proc.returncode}): its shape's {len(build_failed(c, all_cases))} "
                      "case(s) skipped", flush=True)
        elif c.kind == "quantize":
            c.command = quantize_command(c, args, inputs, args.workdir / "peak.json")
            c.result = run_quantize(c, args, inputs)
        elif c.kind == "serve":
            c.result = run_serve(c, args, inputs)
        else:
            c.command = engine_command(c, args, inputs)
            c.result = run_engine(c, args, inputs)
        if last.get((c.shape, c.method)) == c.name:
            shutil.rmtree(artifact(c, args, inputs), ignore_errors=True)
        print(f"   {json.dumps({k: v for k, v in c.result.items() if not isinstance(v, (dict, list))})[:400]}",
              flush=True)
        save(data, all_cases, args.results_dir)
    save(data, all_cases, args.results_dir)


if __name__ == "__main__":
    main()
