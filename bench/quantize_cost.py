"""Quantization cost (issue 10 item 1, issue 14 item 4): wall time and peak memory, quantkit's CLI vs llm-compressor
used directly, on the same token ids.

    python bench/quantize_cost.py --shape 8b                 # the 8B benchmark (make bench-gpu)
    python bench/quantize_cost.py --shape qwen3-30b-a3b-12l --samples 32 --seq-len 2048 --keep quantkit  # MoE
    python bench/quantize_cost.py --shape qwen3-30b-a3b-12l --samples 32 --estimate   # its cost, from FLOPs
    python bench/quantize_cost.py --shape moe-tiny --samples 4 --seq-len 64 --results-dir /tmp/qc   # a logic check

A checkpoint of ``--shape`` (bench/shapes.py: 8b = Llama-3.1-8B's config, qwen3-30b-a3b-12l = Qwen3-30B-A3B's
width with 12 of its 48 layers, tiny = the reference model's, moe-tiny = a small Qwen3-MoE) is built once with
random bf16 weights, with the model class its shape names (initialised on the GPU when there is one), and the
reference model's tokenizer. Random weights are fine for timing: the work AWQ, GPTQ, FP8 and SmoothQuant do depends
on shapes, not values. ``--prepare`` builds it (and the tokens) and stops, so that this untimed step can share the
GPU with other work. Calibration is ``--samples`` x ``--seq-len`` tokens (default 512 x 2048) of the shipped
calibration text, repeated until long enough. quantkit tokenizes it itself; the direct run gets exactly the same
token ids (built once with quantkit.calibration and checked against the sha256 quantkit records), as a user would
pass a tokenized dataset.

For each method (``--methods``: AWQ W4A16 g128, GPTQ W4A16 g128, FP8 static, INT8 SmoothQuant + GPTQ W8A8; an MoE
shape defaults to GPTQ and FP8 static) two processes run one after the other: ``quantkit METHOD SRC OUT --samples N
--seq-len L --calib FILE`` (the real CLI) and a plain llm-compressor script (``--direct``: from_pretrained,
``oneshot`` with the modifiers a user would write from llm-compressor 0.14's examples, GPTQ's with the imatrix_mse
observer quantkit's GPTQ uses by default, ``save_pretrained(save_compressed=True)``). For an MoE model the direct
script is written as llm-compressor 0.14's Qwen3-MoE examples are (examples/awq/qwen3_moe_example.py,
quantization_w4a4_fp4/qwen_30b_a3b.py): the model loaded under ``llmcompressor.utils.load_context()`` (experts
linearized into one Linear per expert projection), the routers kept in full precision with the examples'
``re:.*mlp.gate$`` ignore pattern, and ``oneshot(..., moe_calibrate_all_experts=True)``, so every expert is
calibrated on every token. Each process is timed end to end
(start-up, load, calibration, save; quantkit also hashes its output into a manifest), its peak host RSS sampled from
/proc and its peak GPU memory sampled with nvidia-smi in a thread (memory used on the GPUs minus what was used
before it started). Results are written after every run to bench/results/quantize_cost[_SHAPE].{json,md}, so a
run cut short keeps what it measured.

``--repeat N`` runs each method and tool N times, alternating which goes first, and reports the median;
``--warmup`` runs each tool once more first and does not count it.
``--estimate`` prints what each run should cost on one H200, from its FLOPs (bench/cost_model.py), and runs
nothing: for qwen3-30b-a3b-12l about 11.5 min (GPTQ) and 7.3 min (FP8) per tool at 128 x 2048 tokens, 3.3 and
2.2 min at 32 x 2048 (every expert computes every calibration token, each expert step with its hooks costs about a
millisecond, and GPTQ's float32 Hessians cost as much as the forward passes). The direct script prints its steps'
times (``direct-timings``) as quantkit's manifest gives its own; the markdown lists both for each median run.

Tested with llm-compressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0, torch 2.13.0 (CPU; the tiny
shape, bench/results/quantize_cost_tiny.md, and moe-tiny in tests/test_bench_moe.py). The 8b and
qwen3-30b-a3b-12l shapes have not been run here: see bench/results/README.md.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_model  # noqa: E402
import meta  # noqa: E402
from shapes import BUILDABLE, SHAPES  # noqa: E402

TINY = meta.ROOT / "models" / "quantkit-tiny"
# What each method is, for quantkit's CLI (verb + flags) and for llm-compressor directly (built in direct()).
METHODS = {
    "awq": ("awq", []),  # W4A16 asymmetric, group 128 (quantkit's default, llm-compressor's W4A16_ASYM)
    "gptq": ("gptq", []),  # W4A16 symmetric, group 128, static activation order, 1% dampening, imatrix_mse observer
    "fp8-static": ("fp8", ["--scheme", "static"]),
    "int8-sq": ("int8", []),  # SmoothQuant 0.8, then GPTQ W8A8
}
MOE_METHODS = ["gptq", "fp8-static"]  # what issue 14 asks of the MoE shapes
ROUTER_IGNORE = "re:.*mlp.gate$"  # llm-compressor 0.14's Qwen3-MoE examples keep the routers in full precision


# ----------------------------------------------------------------------------------------------------------------
# Inputs: the checkpoint and the calibration tokens


def make_checkpoint(shape: str, path: Path) -> dict[str, Any]:
    """A random-weight bf16 checkpoint of ``shape``, built with the model class the shape names (reused when one
    with the same config exists). transformers gets a copy of the config: it writes into the nested dicts it is given
    (``rope_theta`` into ``rope_scaling``), and a stamp written from those would never match the next invocation's
    fresh config, so every invocation rebuilt the source (and gave it new inodes, so that quantkit re-hashed it).

    The model is initialised in bf16 (``from_config``'s ``dtype``), not in float32 and then cast: the 32B shape is
    65.5 GB so, which one H100 holds, where float32 needed 131 GB and ran out of memory there (2026-12-06). The GPU's
    cache is emptied afterwards: this process lives through every timed run, and memory its allocator kept would be
    missing from theirs."""
    cfg = {**SHAPES[shape].config(), "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}
    stamp = path / "bench-config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return cfg
    import torch
    import transformers

    shutil.rmtree(path, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 8B parameters is minutes on a CPU
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**copy.deepcopy(cfg))
    with torch.device(device):  # the class transformers maps the config to: the one the shape names
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="5GB")
    transformers.AutoTokenizer.from_pretrained(TINY).save_pretrained(str(path))  # ids 0..8191 valid in every shape
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    stamp.write_text(json.dumps(cfg))
    return cfg


def is_moe(folder: Path) -> bool:
    """Whether a checkpoint has routed experts (its config names how many)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return any(int(cfg.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def make_calibration(path: Path, samples: int, seq_len: int, tokenizer: Any) -> Path:
    """The shipped calibration text repeated until it holds samples x seq_len tokens, as one .jsonl.gz file."""
    docs = []
    for name in ("prose", "code"):
        with gzip.open(meta.ROOT / "calibration" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f if line.strip()]
    have = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 2 for d in docs)
    repeats = samples * seq_len // have + 2
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for _ in range(repeats):
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    return path


def calibration_tokens(calib: Path, samples: int, seq_len: int, tokenizer: Any) -> tuple[list[list[int]], str]:
    """The exact token samples quantkit builds from ``calib`` (same spec, same seed) and their sha256."""
    from quantkit import calibration
    from quantkit.recipe import CalibrationSpec

    cs = calibration.build(CalibrationSpec(dataset=str(calib), samples=samples, seq_len=seq_len), tokenizer)
    return cs.samples, cs.tokens_sha256


# ----------------------------------------------------------------------------------------------------------------
# Measuring one process


class GpuSampler(threading.Thread):
    """Polls nvidia-smi for memory used on every GPU. peak() is the largest rise of the sum over all GPUs above
    its level at start; per_gpu() the largest rise of each GPU on its own (a distributed run's per-rank cost)."""

    def __init__(self, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.interval, self.stop, self.samples = interval, threading.Event(), 0
        self.available = shutil.which("nvidia-smi") is not None
        self.start_used = self._used() if self.available else None
        self.peak_used = list(self.start_used) if self.start_used else None
        self.peak_sum = sum(self.start_used or [])

    def _used(self) -> list[int] | None:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            return None
        return [int(x) * 2**20 for x in out.stdout.split()]  # MiB -> bytes, one per GPU

    def run(self) -> None:
        while self.available and not self.stop.is_set():
            used = self._used()
            if used is not None and self.peak_used is not None and len(used) == len(self.peak_used):
                self.peak_used = [max(a, b) for a, b in zip(self.peak_used, used)]
                self.peak_sum = max(self.peak_sum, sum(used))
                self.samples += 1
            self.stop.wait(self.interval)

    def peak(self) -> int | None:
        if not self.start_used or self.peak_used is None:
            return None
        return self.peak_sum - sum(self.start_used)

    def per_gpu(self) -> list[int] | None:
        if not self.start_used or self.peak_used is None:
            return None
        return [p - s for p, s in zip(self.peak_used, self.start_used)]


def _rss(pid: int) -> tuple[int, int]:
    """Resident memory of ``pid`` and its descendants (bytes), from /proc, all of it and its anonymous part; 0 once
    they are gone.

    The anonymous part is what the process allocated itself and cannot give back under pressure. The rest is mostly
    the source checkpoint, which transformers maps from disk and keeps mapped: clean page-cache pages the kernel can
    drop, counted in RSS for as long as the mapping lives (a checkpoint loaded without conversion is almost all of
    this kind)."""
    total, anon, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                fields = {k: int(v.split()[0]) * 1024 for k, v in (x.split(":", 1) for x in f)
                          if k in ("VmRSS", "RssAnon")}
            total, anon = total + fields.get("VmRSS", 0), anon + fields.get("RssAnon", 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total, anon


def measure(argv: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` to completion: exit code, wall seconds, peak host RSS, peak GPU memory, last stdout line."""
    gpu = GpuSampler()
    gpu.start()
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=meta.ROOT, env=env)
        peak_rss = peak_anon = 0
        out_chunks: list[str] = []
        reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
        reader.start()
        while proc.poll() is None:
            rss, anon = _rss(proc.pid)
            peak_rss, peak_anon = max(peak_rss, rss), max(peak_anon, anon)
            time.sleep(0.2)
        reader.join()
    wall = time.perf_counter() - t0
    gpu.stop.set()
    gpu.join()
    return {"rc": proc.returncode, "wall_s": round(wall, 2), "peak_rss_bytes": peak_rss,
            "peak_anon_rss_bytes": peak_anon, "peak_gpu_bytes": gpu.peak(),
            "peak_gpu_bytes_per_gpu": gpu.per_gpu(), "gpu_samples": gpu.samples,
            "stdout": "".join(out_chunks), "log": str(log)}


# ----------------------------------------------------------------------------------------------------------------
# The direct llm-compressor run (a worker process)


def direct_recipe(method: str, moe: bool = False) -> list[Any]:
    """The modifiers a user would write for each method, following llm-compressor's own examples (for an MoE
    model, its Qwen3-MoE examples: the routers ignored too)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    ignore = ["lm_head", ROUTER_IGNORE] if moe else ["lm_head"]
    if method == "awq":
        return [AWQModifier(duo_scaling=True),
                QuantizationModifier(targets=["Linear"], scheme="W4A16_ASYM", ignore=ignore)]
    if method == "gptq":
        # quantkit's default GPTQ chooses each group's range with llm-compressor's imatrix_mse observer
        # (GptqSpec.imatrix, about 6% more time than the scheme's minmax): the same here, so both do the same work
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
                   "group_size": 128, "observer": "imatrix_mse"}
        return [GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                             targets=["Linear"], ignore=ignore, actorder="static", dampening_frac=0.01)]
    if method == "fp8-static":
        return [QuantizationModifier(targets=["Linear"], scheme="FP8", ignore=ignore)]
    if method == "int8-sq":
        return [SmoothQuantModifier(smoothing_strength=0.8),
                GPTQModifier(targets=["Linear"], scheme="W8A8", ignore=ignore)]
    raise SystemExit(f"unknown method {method}")


def load_direct(src: str) -> tuple[Any, str]:
    """The model as llm-compressor 0.14's examples load it, and how it was loaded.

    An MoE model is loaded under ``load_context()``, which builds one Linear per expert projection straight from
    the checkpoint's per-expert tensors. Entering it needs torchvision (transformers 5.17's class patching imports
    every image processor); where that is missing (this project's CPU environment, not the H200 image) the experts
    are linearized right after a plain load with llm-compressor's ``linearize_moe``, the step ``oneshot`` falls back
    to itself. The same modules are calibrated either way; only the load differs, and the results say which."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    if not is_moe(Path(src)):
        return AutoModelForCausalLM.from_pretrained(src, dtype="auto"), "from_pretrained"
    if importlib.util.find_spec("torchvision") is None:
        from llmcompressor.modeling.moe.linearize import linearize_moe

        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
        linearize_moe(model)
        return model, "from_pretrained + linearize_moe (no torchvision for load_context)"
    from llmcompressor.utils import load_context

    with load_context():
        return AutoModelForCausalLM.from_pretrained(src, dtype="auto"), "load_context"


def load_distributed(src: str) -> tuple[Any, str]:
    """One torchrun rank's model, as llm-compressor 0.14's DDP example loads it (examples/quantization_w4a16/
    llama3_ddp_example.py): ``init_dist()``, then ``from_pretrained(device_map="auto_offload")`` under
    ``load_offloaded_model()`` (rank 0 reads the checkpoint, the other ranks share it)."""
    from compressed_tensors.offload import init_dist, load_offloaded_model
    from transformers import AutoModelForCausalLM

    if is_moe(Path(src)):
        raise SystemExit("the direct DDP script follows llm-compressor's dense example: no MoE shape")
    init_dist()
    with load_offloaded_model():
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", device_map="auto_offload")
    return model, "load_offloaded_model + device_map=auto_offload (DDP example)"


def since_process_start() -> float:
    """Seconds since this process started (Linux: /proc), so the interpreter's own start-up is counted too."""
    after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def direct(method: str, src: str, out: str, tokens: str) -> None:
    """Load, oneshot, save: llm-compressor with no quantkit code in the process. Prints how it loaded the model
    (``direct-load: ...``) and how long each step took (``direct-timings: {...}``: the interpreter's start-up to
    here, the imports, load, oneshot, save; what quantkit's manifest gives for its own steps) on stdout.

    Under torchrun (``WORLD_SIZE`` > 1) it is llm-compressor's DDP example: each rank takes its own slice of the
    samples (the example's ``get_rank_partition``), calibrates on it, and every rank calls ``save_pretrained``."""
    timings = {"start": round(since_process_start(), 3)}
    t0 = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal t0
        timings[step] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoTokenizer
    lap("imports")

    samples = json.loads(Path(tokens).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        model, how = load_distributed(src)
        rank = dist.get_rank()
        samples = samples[len(samples) * rank // world:len(samples) * (rank + 1) // world]
    else:
        model, how = load_direct(src)
        rank = 0
    if rank == 0:
        print(f"direct-load: {how}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    lap("load")
    torch.manual_seed(0)
    moe = is_moe(Path(src))
    extra = {"moe_calibrate_all_experts": True} if moe else {}
    oneshot(model=model, recipe=direct_recipe(method, moe), dataset=Dataset.from_dict({"input_ids": samples}),
            num_calibration_samples=len(samples), max_seq_length=len(samples[0]), shuffle_calibration_samples=False,
            **extra)
    lap("oneshot")
    model.save_pretrained(out, save_compressed=True)
    if rank == 0:
        tokenizer.save_pretrained(out)
        lap("save")
        print(f"direct-timings: {json.dumps(timings)}", flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# The benchmark


def results_name(shape: str) -> str:
    return "quantize_cost" if shape == "8b" else f"quantize_cost_{shape}"


def parse_tool(spec: str) -> tuple[str, int]:
    """``quantkit``, ``llm-compressor`` or either with ``@N`` GPUs (``quantkit@2``: quantkit's ``--num-gpus 2``;
    ``llm-compressor@2``: its DDP example under torchrun)."""
    name, _, n = spec.partition("@")
    return name, int(n or 1)


def tool_label(name: str, gpus: int) -> str:
    return name if gpus == 1 else f"{name} x{gpus}"


def split_label(label: str) -> tuple[str, int]:
    name, _, n = label.partition(" x")
    return name, int(n or 1)


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def gpu_cell(r: dict[str, Any]) -> str:
    """Peak GPU memory: the sum over GPUs, and each GPU's own peak where the run used more than one."""
    per = r.get("peak_gpu_bytes_per_gpu") or []
    used = [x for x in per if x > 256 * 2**20]
    if len(used) > 1:
        return f"{gib(r['peak_gpu_bytes'])} ({' + '.join(f'{x / 2**30:.2f}' for x in per)})"
    return gib(r["peak_gpu_bytes"])


def moe_note(data: dict[str, Any]) -> str:
    """How the direct script treats an MoE model (the table must say what was compared)."""
    cfg = data.get("config") or {}
    if not any(int(cfg.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts")):
        return ""
    return (f" {data.get('architecture')}, {cfg.get('num_experts') or cfg.get('num_local_experts')} experts, top-"
            f"{cfg.get('num_experts_per_tok')}. The direct script follows llm-compressor 0.14's Qwen3-MoE example: "
            "experts linearized at load (`load_context()`; how it loaded is said below), routers ignored "
            f"(`{ROUTER_IGNORE}`), `moe_calibrate_all_experts=True` (every expert sees every calibration token).")


def steps(r: dict[str, Any]) -> str:
    """One run's steps in seconds, as its tool reports them (quantkit: its manifest's timings; the direct script:
    start-up to its main, imports, load, oneshot, save), and the rest of its wall time (start-up and exit)."""
    parts = {k: v for k, v in (r.get("timings") or {}).items() if k != "total" and isinstance(v, (int, float))}
    if not parts:
        return ""
    named = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts.items())
    return f"{named}, the rest {r['wall_s'] - sum(parts.values()):.1f}"


def markdown(data: dict[str, Any]) -> str:
    """The table: one row per method and tool, and quantkit's overhead over the direct run."""
    lines = [f"# Quantization cost: quantkit vs llm-compressor directly ({data['shape']} shape)", "",
             meta.md_header(data), f"Random bf16 weights, {data['parameters'] / 1e9:.2f}B parameters; calibration "
             f"{data['samples']} x {data['seq_len']} tokens (tokens sha256 {data['tokens_sha256'][:12]}, identical for "
             "both tools). Wall = the whole process (start-up, load, calibration, save; quantkit also hashes its "
             "output). Peak host RSS: all resident memory, and (in brackets) its anonymous part, what the process "
             "allocated and cannot give back; the rest is mostly the checkpoint mapped from disk. Peak GPU = "
             "nvidia-smi memory used minus the level before start." + moe_note(data), "",
             "| method | tool | rc | wall | quantize step | peak host RSS (anon) | peak GPU (per GPU) | "
             "quantkit overhead | speed-up over 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = lambda r: bool(r) and r["rc"] == 0  # noqa: E731
    for method, runs in data["runs"].items():
        order = sorted(runs, key=lambda lab: (split_label(lab)[1], split_label(lab)[0] != "quantkit"))
        for label in order:
            r = runs[label]
            name, gpus = split_label(label)
            over = speedup = ""
            d = runs.get(tool_label("llm-compressor", gpus))
            if name == "quantkit" and ok(r) and ok(d):
                over = f"{(r['wall_s'] / d['wall_s'] - 1):+.1%}"
                if len(r.get("walls_s") or []) > 1 and len(d.get("walls_s") or []) > 1:
                    over += f" (means {mean(r['walls_s']) / mean(d['walls_s']) - 1:+.1%})"
            one = runs.get(name)
            if gpus > 1 and ok(r) and ok(one):
                speedup = f"{one['wall_s'] / r['wall_s']:.2f}x"
            step = f"{r['quantize_s']:.1f}s" if r.get("quantize_s") is not None else "-"
            walls = r.get("walls_s") or [r["wall_s"]]
            spread = f" ({min(walls):.1f}-{max(walls):.1f})" if len(walls) > 1 else ""
            anon = f" ({gib(r['peak_anon_rss_bytes'])})" if r.get("peak_anon_rss_bytes") else ""
            lines.append(f"| {method} | {label} | {r['rc']} | {r['wall_s']:.1f}s{spread} | {step} | "
                         f"{gib(r['peak_rss_bytes'])}{anon} | {gpu_cell(r)} | {over} | {speedup} |")
    if len(data.get("commands") or []) > 1:
        lines[3:3] = ["Runs merged with --append, from these commands in order: "
                      + "; ".join(f"`{c}`" for c in data["commands"]) + ".", ""]
    lines += ["", "quantkit overhead = quantkit wall / llm-compressor wall - 1 on the same number of GPUs (the issue's "
              "bound: within 2%); \"x2\" = `--num-gpus 2` for quantkit, llm-compressor's DDP example "
              "(examples/quantization_w4a16/llama3_ddp_example.py) under torchrun for llm-compressor. Speed-up = "
              "the same tool's wall on 1 GPU over its wall on N. With --repeat, wall is the median run's (of two, the "
              "faster) and (min-max) spans all runs; the overhead is then also given on the means of all runs, "
              "which a machine whose runs spread more than the difference needs."]
    timed = [f"- {method} / {label}, {r['wall_s']:.1f} s: {steps(r)}" for method, runs in data["runs"].items()
             for label, r in runs.items() if r["rc"] == 0 and steps(r)]
    if timed:
        lines += ["", "Steps of each median run, in seconds (quantkit: its manifest's timings; the direct script: from "
                  "the interpreter's start to its main, then its imports, load, oneshot and save; the rest is what the "
                  "wall time holds beyond them):", "", *timed, ""]
    loads = sorted({r["load"] for runs in data["runs"].values() for t, r in runs.items() if r.get("load")})
    if loads:
        lines.append(f"The direct script loaded the model with: {'; '.join(loads)}.")
    differ = [m for m, runs in data["runs"].items() if (runs.get("quantkit") or {}).get("same_tokens_as_direct") is False]
    if differ:
        lines.append(f"WARNING: quantkit calibrated on other tokens than the direct run for {', '.join(differ)}.")
    failed = [f"{m} / {t}: `{r.get('error') or r['log']}`" for m, runs in data["runs"].items()
              for t, r in runs.items() if r["rc"]]
    if failed:
        lines.append("Failed runs (the last line of each log): " + "; ".join(failed) + ".")
    lines.append("")
    return "\n".join(lines)


def run_one(args: argparse.Namespace, spec: str, method: str, verb: str, flags: list[str], src: Path, calib: Path,
            tokens: Path, sha: str, env: dict[str, str]) -> dict[str, Any]:
    """One timed process: quantkit's CLI or the direct llm-compressor script (``tool@N``: on N GPUs), on the same
    tokens."""
    tool, gpus = parse_tool(spec)
    suffix = "" if gpus == 1 else f"-x{gpus}"
    out = args.workdir / f"out-{tool}-{method}{suffix}"
    shutil.rmtree(out, ignore_errors=True)
    if tool == "quantkit":
        argv = [sys.executable, "-m", "quantkit", verb, str(src), str(out), *flags, "--calib", str(calib),
                "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--device", args.device, "--json"]
        if gpus > 1:
            argv += ["--num-gpus", str(gpus)]
    else:
        argv = [sys.executable, str(Path(__file__).resolve()), "--direct", method, str(src), str(out), str(tokens)]
        if gpus > 1:
            argv[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    print(f"== {method} / {tool_label(tool, gpus)}", flush=True)
    r = measure(argv, args.workdir / f"{tool}-{method}{suffix}.log", env)
    r["command"] = " ".join(argv)
    r.update(reported(tool, r.pop("stdout"), r["rc"]))
    if tool == "quantkit" and r["rc"] == 0:
        r["same_tokens_as_direct"] = r["calibration_tokens_sha256"] == sha
    if r["rc"]:
        tail = [line for line in Path(r["log"]).read_text(errors="replace").splitlines() if line.strip()]
        r["error"] = tail[-1].strip() if tail else ""
    r["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.exists() else 0
    if args.keep not in ("all", tool):
        shutil.rmtree(out, ignore_errors=True)
    return r


def reported(tool: str, stdout: str, rc: int) -> dict[str, Any]:
    """What a run said of itself on stdout: its steps' seconds (``timings``, what :func:`steps` shows) and, for
    quantkit, its calibration tokens' hash from the manifest the CLI prints with ``--json``; for the direct script,
    how it loaded the model. Without the steps two walls can be compared but the difference not traced to a step."""
    if tool == "quantkit":
        if rc:
            return {}
        manifest = json.loads(stdout)[0]  # the CLI prints one entry per output
        timings = manifest.get("timings")
        return {"quantize_s": (timings or {}).get("quantize"), "timings": timings,
                "calibration_tokens_sha256": (manifest.get("calibration") or {}).get("tokens_sha256")}
    said = dict(line.split(": ", 1) for line in stdout.splitlines() if line.startswith("direct-"))
    return {"load": said.get("direct-load"),
            "timings": json.loads(said["direct-timings"]) if "direct-timings" in said else None}


def median_run(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (failed runs count as slowest), with every try's wall time beside it."""
    ranked = sorted(tries, key=lambda r: (r["rc"] != 0, r["wall_s"]))
    return {**ranked[(len(ranked) - 1) // 2], "walls_s": [r["wall_s"] for r in tries]}


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The inputs every run shares: the random checkpoint, the calibration file and its exact token ids."""
    from transformers import AutoTokenizer

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"src-{args.shape}"
    cfg = make_checkpoint(args.shape, src)
    tok = AutoTokenizer.from_pretrained(src)
    calib = make_calibration(work / "calib.jsonl.gz", args.samples, args.seq_len, tok)
    samples, sha = calibration_tokens(calib, args.samples, args.seq_len, tok)
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps(samples))
    return {"src": src, "config": cfg, "calib": calib, "tokens": tokens, "sha": sha}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    inputs = prepare(args)
    src, calib, tokens, sha = inputs["src"], inputs["calib"], inputs["tokens"], inputs["sha"]
    from quantkit.recipe import ModelSpec
    from quantkit.source import resolve

    data: dict[str, Any] = {**meta.header(), "shape": args.shape, "architecture": SHAPES[args.shape].architecture,
                            "config": inputs["config"],
                            "parameters": resolve(ModelSpec(source=str(src))).num_parameters,
                            "samples": args.samples, "seq_len": args.seq_len, "tokens_sha256": sha, "runs": {}}
    name = args.name or results_name(args.shape)
    if args.append and (old_file := args.results_dir / f"{name}.json").exists():
        old = json.loads(old_file.read_text())
        if (old.get("shape"), old.get("tokens_sha256")) != (args.shape, sha):
            raise SystemExit(f"--append: {old_file} measured other inputs (shape {old.get('shape')}, tokens "
                             f"{str(old.get('tokens_sha256'))[:12]})")
        data["runs"] = old["runs"]
        data["commands"] = [*old.get("commands", [old.get("command")]), data["command"]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "LLM_COMPRESSOR_LOG_LEVEL": os.environ.get("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")}
    for method in args.methods:
        verb, flags = METHODS[method]
        runs = data["runs"].setdefault(method, {})
        tries: dict[str, list[dict[str, Any]]] = {spec: [] for spec in args.tools}
        for spec in args.tools if args.warmup else []:  # untimed: the page cache, the GPU's clocks, JIT caches
            r = run_one(args, spec, method, verb, flags, src, calib, tokens, sha, env)
            print(f"   warm-up, not counted: rc {r['rc']}, {r['wall_s']}s", flush=True)
        for rep in range(args.repeat):
            # Alternate which tool goes first, so neither always meets a warm page cache or a cooler CPU.
            for spec in (args.tools if rep % 2 == 0 else args.tools[::-1]):
                r = run_one(args, spec, method, verb, flags, src, calib, tokens, sha, env)
                tries[spec].append(r)
                runs[tool_label(*parse_tool(spec))] = median_run(tries[spec])
                meta.write(name, data, markdown(data), args.results_dir)
                print(f"   rc {r['rc']}, {r['wall_s']}s, peak GPU {gib(r['peak_gpu_bytes'])}", flush=True)
    return data


def estimates(args: argparse.Namespace) -> str:
    """``--estimate``: the FLOP-based cost of each modelled method at the asked size (and at 128 and 32 samples
    of 2048 tokens, the sizes a short GPU run chooses between)."""
    shape = SHAPES[args.shape]
    sizes = list(dict.fromkeys([(args.samples, args.seq_len), (128, 2048), (32, 2048)]))
    rows = [cost_model.estimate(shape, m, n, L) for m in args.methods if m in cost_model.MODELLED for n, L in sizes]
    if not rows:
        raise SystemExit(f"--estimate models {', '.join(cost_model.MODELLED)} only")
    return cost_model.markdown(args.shape, shape, rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--direct":
        direct(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(BUILDABLE), default="8b")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--methods", type=lambda s: s.split(","),
                    help=f"comma-separated, from {', '.join(METHODS)} [default: all; {','.join(MOE_METHODS)} for "
                         "an MoE shape]")
    ap.add_argument("--tools", type=lambda s: s.split(","), default=["llm-compressor", "quantkit"],
                    help="comma-separated, each quantkit or llm-compressor, with @N to run it on N GPUs "
                         "(quantkit@1,quantkit@2,llm-compressor@2)")
    ap.add_argument("--name", help="result file name (NAME.json, NAME.md) [default: quantize_cost[_SHAPE]]")
    ap.add_argument("--append", action="store_true", help="add to the runs already in NAME.json (same inputs)")
    ap.add_argument("--device", default="auto", help="quantkit's --device (llm-compressor picks the same way)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-qcost"))
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS)
    ap.add_argument("--keep", nargs="?", const="all", choices=["all", "quantkit", "llm-compressor"],
                    help="keep the quantized outputs (all, or one tool's: serve_speed.py reads quantkit's)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per method and tool; the table shows the median")
    ap.add_argument("--warmup", action="store_true",
                    help="one untimed run of each tool per method first (the first run of a sitting was the slowest "
                         "of six on the H200: 54.7 s against 41.7-48.1 s)")
    ap.add_argument("--prepare", action="store_true", help="build the checkpoint and the tokens, time nothing")
    ap.add_argument("--estimate", action="store_true", help="print each run's cost from its FLOPs, run nothing")
    args = ap.parse_args()
    if args.methods is None:
        args.methods = MOE_METHODS if SHAPES[args.shape].moe else list(METHODS)
    bad = [m for m in args.methods if m not in METHODS] + [
        t for t in args.tools if parse_tool(t)[0] not in ("quantkit", "llm-compressor")]
    if bad:
        ap.error(f"unknown method or tool: {', '.join(bad)}")
    if args.estimate:
        print(estimates(args))
    elif args.prepare:
        inputs = prepare(args)
        print(f"{inputs['src']}\n{inputs['tokens']} (sha256 {inputs['sha'][:12]})")
    else:
        print(markdown(bench(args)))


if __name__ == "__main__":
    main()
