"""bench/results/README.md: every benchmark table in one page, each with the command and machine behind it.

Rebuilt by ``python bench/run.py`` after each benchmark (and on its own with ``python bench/run.py index``) from
the committed result files, so the page never disagrees with them. Standard library only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from meta import RESULTS

H200 = RESULTS / "h200"
H100 = RESULTS / "h100"


def _body(md: Path) -> str:
    """A result's markdown without its level-1 title (the index gives each its own section heading)."""
    text = md.read_text().strip()
    return re.sub(r"\A# .*\n+", "", text)


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def quality() -> list[str]:
    md = RESULTS / "quality.md"
    if not md.exists():
        return ["Not run yet: `python bench/run.py quality`.", ""]
    return [_body(md), ""]


def gguf() -> list[str]:
    data = _read(RESULTS / "gguf_convert.json") or {}
    dates = sorted({r.get("date") for r in data.values() if r.get("date")})
    cpus = sorted({str(r.get("cpus")) for r in data.values() if r.get("cpus")})
    lines = [_body(RESULTS / "gguf_convert.md"), "",
             f"Command: `python bench/gguf_convert.py --shape SHAPE` (SHAPE = {', '.join(data)}; "
             f"`python bench/run.py gguf` runs the 8b shape). Machine: this project's x86_64 CPU machine "
             f"({'/'.join(cpus)} cores, Intel Xeon), measured {', '.join(dates)}. These entries predate "
             "bench/run.py, so they carry no versions block; a re-run through it adds one to its entry.", ""]
    return lines


def gguf_imatrix() -> list[str]:
    """The dense reference model's table, then the MoE reference model's (per-expert matrices)."""
    lines: list[str] = []
    for name, bench, title in (("gguf_imatrix", "gguf-imatrix", "The reference model"),
                               ("gguf_imatrix_moe", "gguf-imatrix-moe", "The MoE reference model")):
        md = RESULTS / f"{name}.md"
        lines += [f"### {title}", "", _body(md) if md.exists() else f"Not run yet: `python bench/run.py {bench}`.", ""]
    return lines


def eval_agreement() -> list[str]:
    """The same artifacts scored by vLLM and by transformers on CUDA: how far apart the two engines are."""
    v, t = _read(H200 / "eval_vllm_tiny.json"), _read(H200 / "eval_transformers_cuda_tiny.json")
    if not v or not t:
        return ["Missing h200/eval_*_tiny.json.", ""]
    tr = {r["label"]: r for r in t["results"]}
    p = v["protocol"]
    ve, te = v["results"][0]["engine"], t["results"][0]["engine"]
    lines = [f"Reference model, {p['dataset']} split, ctx {p['ctx']}, {p['tokens_scored']} tokens, the same windows "
             f"(windows sha256 {p['windows_sha256'][:12]} in both files); baseline ppl "
             f"{t['baseline']['ppl']:.3f} (transformers on CUDA, bf16) in both. "
             f"vLLM {ve.get('version')} on {ve.get('device')} returns the top-{ve.get('topk')} log-probabilities, so "
             "its KLD is a lower bound (top-k bins plus one bin for the rest); transformers "
             f"{te.get('version')} (torch {te.get('torch')}) gives the full distribution (exact KLD).", "",
             "| artifact | ppl transformers | ppl vLLM | ppl diff | KLD transformers | KLD vLLM (bound) | "
             "top-1 transformers | top-1 vLLM |", "|---|---|---|---|---|---|---|---|"]
    for r in v["results"]:
        x = tr.get(r["label"])
        if not x:
            continue
        lines.append(f"| {r['label']} | {x['ppl']:.3f} | {r['ppl']:.3f} | {(r['ppl'] / x['ppl'] - 1):+.2%} | "
                     f"{x['kld']:.5f} | {r['kld']:.5f} | {x['top1']:.4f} | {r['top1']:.4f} |")
    lines += ["", "Command (H200, the artifacts of the reference model's `tiny` and `legacy` cases of "
              "scripts/gpu_cases.yaml; the files do not record it, this is its form): `quantkit eval ARTS --baseline "
              "models/quantkit-tiny --dataset heldout --ctx 2048 --max-tokens 32768 --engine vllm|transformers "
              "--json`; files: h200/eval_vllm_tiny.json, h200/eval_transformers_cuda_tiny.json.", ""]
    return lines


def quantize_tiny() -> list[str]:
    """Per-method quantization time of the reference model on the H200 (the timings quantkit's manifests record)."""
    data = _read(H200 / "quantize_tiny.json")
    if not data:
        return ["Missing h200/quantize_tiny.json.", ""]
    lines = ["| artifact | load s | calibration data s | quantize s | save s | total s |", "|---|---|---|---|---|---|"]
    for name, t in data["timings"].items():
        lines.append(f"| {name} | {t.get('load_model', 0):.2f} | {t.get('calibration_data', 0):.2f} | "
                     f"{t.get('quantize', 0):.2f} | {t.get('save', 0):.2f} | {t.get('total', 0):.1f} |")
    lines += ["", f"Command: `{data['command']}`, on one H200; the times are each artifact's manifest `timings` "
              "(h200/quantize_tiny.json). Total runs from quantkit's source check to the end of producing, so it "
              "also holds the producer's (lazy) imports of torch, transformers and llm-compressor: at this size those, "
              "not the quantization, are most of it. The run recorded neither machine block nor versions (it predates "
              "bench/); the machine was one H200 with 16 CPU cores.", ""]
    return lines


def quantize_cost() -> list[str]:
    lines: list[str] = []
    md = RESULTS / "quantize_cost.md"
    sealed, h200 = H200 / "8b" / "quantize_cost_8b_sealed.md", H200 / "8b" / "quantize_cost_8b.md"
    if md.exists():
        lines += [_body(md), ""]
    for name, what in (("quantize_cost_8b_fp8_hash_and_sync", "FP8 static, three runs per tool, the last shard "
                        "hashed and fsynced side by side (the third sitting)"),
                       ("quantize_cost_8b_awq_3x3", "AWQ W4A16, three runs per tool (the fifth sitting)"),
                       ("quantize_cost_8b_int8-sq_3x3", "INT8 SmoothQuant, three runs per tool (the fourth "
                        "sitting)"),
                       ("quantize_cost_8b_fp8_warm", "FP8 static, a warm-up and three runs per tool"),
                       ("quantize_cost_8b_int8_medians", "INT8 SmoothQuant, two quantkit runs and one direct"),
                       ("quantize_cost_8b_fp8_profiled", "FP8 static, one run per tool under py-spy"),
                       ("fp8_profile", "where those two runs spent their time, read by bench/profile_phases.py")):
        if (h100 := H100 / "8b" / f"{name}.md").exists():
            lines += [f"### The 8B shape on one H100: {what} (issue 44; h100/8b/README.md)", "",
                      re.sub(r"^## ", "#### ", _body(h100), flags=re.M), ""]
    medians = H200 / "8b" / "quantize_cost_8b_medians.md"
    if medians.exists():
        lines += ["### The 8B shape on one H200, medians of three runs per tool (issue 44; h200/8b/README.md)", "",
                  _body(medians), ""]
    if sealed.exists():
        lines += ["### The 8B shape on one H200, quantkit sealing its output while it is written (issue 16; "
                  "h200/8b/README.md)", "",
                  "quantkit's AWQ run here offloaded its cached activations to host memory (then its default, "
                  "since off); llm-compressor's did not.", "", _body(sealed), ""]
    if h200.exists():
        lines += ["### The 8B shape on one H200, the run before (quantkit hashing its output after the save)", "",
                  _body(h200), ""]
    project = H200 / "70b" / "project_70b.md"
    if project.exists():
        lines += ["### 70B and 405B, projected from the 70B width with 4 and 8 layers (h200/70b/README.md)", "",
                  _body(project), ""]
    if not (md.exists() or h200.exists()):
        lines += ["**Not run on the H200.** `bench/quantize_cost.py` (`make bench-gpu`: 8B-shaped Llama-3.1-8B config "
                  "with random bf16 weights, 512 x 2048 calibration tokens, AWQ / GPTQ / FP8 static / INT8-SQ through "
                  "quantkit's CLI next to the same recipe written directly against llm-compressor, wall time and "
                  "nvidia-smi peak GPU memory) is written, but the H200 time available to this work was used up by "
                  "the vLLM results below, so there are no 8B figures. The 70B question is open too: `--shape 70b` "
                  "writes a ~141 GB bf16 checkpoint, more than the one-GPU machine's 64 GiB of disk.", ""]
    for name, heading in (
            ("quantize_cost_1b", "On this CPU, the 1B shape: GPTQ, INT8 and FP8 with quantkit sealing its output "
                                 "(issue 16's methods where no H200 was left)"),
            ("quantize_cost_1b_fp8_warm", "On this CPU, the 1B shape: FP8 static, three runs per tool after a "
                                          "warm-up each (issue 44 item 2, the steps beside each other)"),
            ("quantize_cost_3b", "On this CPU, the 3B shape: FP8 with quantkit sealing its output"),
            ("quantize_cost_3b_before_sealing", "On this CPU, the 3B shape: FP8 with quantkit hashing its output "
                                                "after the save"),
            ("seal_speed", "Sealing alone on this CPU: three shards in memory (/dev/shm), the sealer hashing files "
                           "in parallel"),
            ("seal_speed_before", "Sealing alone on this CPU: the same, the sealer as it ran on the H200 (one file at "
                                  "a time)"),
            ("seal_speed_disk", "Sealing alone on this CPU: one 1.5 GB file on this machine's disk"),
            ("seal_speed_hash_then_sync", "Sealing alone on this CPU: two 1 GB shards on this machine's disk, each "
                                          "file hashed and then fsynced"),
            ("seal_speed_hash_with_sync", "Sealing alone on this CPU: the same, each file's hash and fsync side by "
                                          "side (seal.hash_and_sync)")):
        if (RESULTS / f"{name}.md").exists():
            lines += [f"### {heading}", "", _body(RESULTS / f"{name}.md"), ""]
    tiny = RESULTS / "quantize_cost_tiny.md"
    if tiny.exists():
        lines += ["### The same script on this CPU, the reference model's shape", "",
                  "At this size the fixed costs (process start-up, imports, quantkit's source check, manifest and "
                  "hashing) are a visible share of a job of half a minute; an 8B run is needed for the ratio the "
                  "issue asks about.", "", _body(tiny), ""]
    return lines


def moe() -> list[str]:
    """Issue 14's MoE benchmarks: quantization cost and serving speed of Qwen3-30B-A3B's width (12 layers)."""
    lines: list[str] = []
    for name, what in (("quantize_cost_qwen3-30b-a3b-12l", "quantization cost"), ("serve_speed_moe", "serving speed")):
        md = RESULTS / f"{name}.md"
        lines += [f"### MoE {what}", "", _body(md) if md.exists() else f"**Not run yet** ({name}.md).", ""]
    cpu = RESULTS / "quantize_cost_qwen3-30b-a3b-2l.md"
    if cpu.exists():
        lines += ["### MoE host memory, 2 of 48 layers on the CPU (experts linearized block by block)", "",
                  _body(cpu), ""]
    for name, heading in (("moe_load_qwen3-30b-a3b-2l", "2 of 48 layers"),
                          ("moe_load_qwen3-30b-a3b-header-only", "all 48 layers, header-only (no weight read)")):
        if (md := RESULTS / f"{name}.md").exists():
            lines += [f"### MoE load alone, {heading}, on the CPU (per-expert checkpoint into per-expert Linears)",
                      "", _body(md), ""]
    if not (RESULTS / "quantize_cost_qwen3-30b-a3b-12l.md").exists():
        lines += ["Written and checked on this CPU with the tiny MoE shape (tests/test_bench_moe.py): "
                  "`python bench/quantize_cost.py --shape qwen3-30b-a3b-12l --samples 32 --seq-len 2048 "
                  "--keep quantkit` "
                  "(GPTQ W4A16 and FP8 static, quantkit's CLI next to llm-compressor 0.14's Qwen3-MoE example on the "
                  "same tokens; `--estimate` prints the FLOP-based cost: about 2.3 and 1.6 min per tool at 32 x 2048, "
                  "4.7 and 2.2 min at 128 x 2048), then `python3 bench/serve_speed.py "
                  "WORKDIR/src-qwen3-30b-a3b-12l WORKDIR/out-quantkit-{gptq,fp8-static} --python VLLM_PYTHON "
                  "--name serve_speed_moe` (bf16, W4A16, FP8 at batch 1 and 16, with "
                  "the bandwidth limit from the bytes a decode step reads: top-k experts at batch 1, the expected "
                  "distinct experts at batch 16).", ""]
    return lines


def two_gpus() -> list[str]:
    """Issue 18's runs on two H200s: agreement, quantization cost, tensor-parallel serving."""
    folder = RESULTS / "h200x2"
    lines = ["Files and the run's account: h200x2/README.md.", ""]
    for name, what in (("ddp_agreement", "Distributed calibration gives the same artifact"),
                       ("quantize_cost_8b_x2", "Quantization cost on 1 and 2 GPUs"),
                       ("serve_speed_8b_tp", "Serving with tensor parallelism")):
        md = folder / f"{name}.md"
        lines += [f"### {what}", "", _body(md) if md.exists() else f"**Not run yet** (h200x2/{name}.md).", ""]
    return lines


def serve_speed() -> list[str]:
    md = RESULTS / "serve_speed.md"
    if md.exists():
        return [_body(md), "", "### The reference model's artifacts", ""]
    h200 = [H200 / "8b" / f"{name}.md" for name in ("serve_speed_8b", "tune_gptq_8b")]
    if all(f.exists() for f in h200):
        return ["### The 8B shape: bf16, W4A8 and FP8 (h200/8b/README.md)", "", _body(h200[0]), "",
                "### The 8B shape's W4A16 artifact under every linear kernel (`quantkit tune`)", "", _body(h200[1]), "",
                "### The reference model's artifacts", ""]
    return ["**The 8B-shaped serving benchmark has not been run.** `bench/serve_speed.py` (TTFT and decode tok/s at "
            "batch 1 and 16 in vLLM for the bf16 source and each artifact, the kernel vLLM chose, and the "
            "memory-bandwidth limit: batch x 4.8 TB/s / bytes read per decode step) is written; its parent was run "
            "on this CPU machine against the reference model (bytes per step, the failure path), the vLLM child "
            "needs the H200. Below are the reference model's artifacts, which show which kernel vLLM picks for each "
            "format (at this size tokens/s measure per-step overhead, not weight bandwidth).", ""]


def wide() -> list[str]:
    """Issue 44 item 3: 32B-class widths on one GPU (bench/wide.py on an H200, 8 of 64 layers; the full 32B shape
    on an H100, FP8 static through bench/quantize_cost.py and GPTQ through bench/wide.py, served by vLLM; the full
    30B-A3B on an H100, FP8 static and GPTQ through bench/wide.py (both tools in one sitting each), FP8 served;
    each folder's README is the account)."""
    lines: list[str] = []
    for md, heading in ((H200 / "wide" / "README.md", None),
                        (H100 / "32b" / "README.md", "The full 32B shape on one H100 (h100/32b/README.md)"),
                        (H100 / "30b-a3b" / "README.md",
                         "The full 30B-A3B MoE shape on one H100 (h100/30b-a3b/README.md)")):
        if not md.exists():
            continue
        if heading:
            lines += [f"### {heading}", ""]
        # its "## " go under this page's own "## 8.", and under the heading where there is one
        lines += [re.sub(r"^## ", "#### " if heading else "### ", _body(md), flags=re.M), ""]
    return lines or ["**Not run yet** (h200/wide/README.md).", ""]


def _folder_sections(results: tuple[tuple[Path, str], ...]) -> list[str]:
    """Each result page that exists under its heading, named with its folder, its own "## " one level down."""
    lines: list[str] = []
    for md, heading in results:
        if md.exists():
            lines += [f"### {heading} ({md.parent.relative_to(RESULTS).as_posix()}/)", "",
                      re.sub(r"^## ", "#### ", _body(md), flags=re.M), ""]
    return lines or ["**Not run yet.**", ""]


def serve_bench() -> list[str]:
    """Issue 44 item 4: throughput and latency at several concurrencies against bf16 (bench/serve_bench.py)."""
    return _folder_sections(
        ((H100 / "8b" / "serve_bench_8b_vllm" / "results.md", "The 8B shape in vLLM on one H100"),
         (H100 / "8b" / "serve_bench_8b_sglang" / "results.md", "The 8B shape in SGLang on one H100"),
         (H100 / "8b" / "serve_bench_8b_sglang_w4a16" / "results.md",
          "The 8B shape's GPTQ W4A16 in SGLang on one H100 (the third sitting)"),
         (H100 / "8b" / "serve_bench_8b_vllm_nvfp4" / "results.md",
          "The 8B shape's NVFP4 in vLLM on one H100 (the third sitting)"),
         (H100 / "8b" / "serve_bench_8b_vllm_awq_int8" / "results.md",
          "The 8B shape's AWQ and INT8 in vLLM on one H100 (the sixth sitting)"),
         (H100 / "8b" / "serve_bench_8b_sglang_awq_int8" / "results.md",
          "The 8B shape's INT8 in SGLang on one H100 (the sixth sitting; AWQ did not start in time)"),
         (H100 / "8b" / "serve_bench_8b_sglang_awq" / "results.md",
          "The 8B shape's AWQ in SGLang on one H100 (the seventh sitting)"),
         (H200 / "serve_bench_smollm2_vllm" / "results.md", "SmolLM2-135M-Instruct in vLLM on one H200"),
         (RESULTS / "smollm2_llamacpp_cpu" / "results.md",
          "SmolLM2-135M-Instruct's GGUF files in llama-server on this CPU (the script end to end, "
          "not a speed)")))


def eval_speed() -> list[str]:
    """Issue 44 item 1: each engine's scored tokens per second on the same tokens (bench/eval_speed.py), on the
    H200, on an H100 (SGLang's scoring with it) and on this project's 2-core CPU."""
    return _folder_sections(
        ((H200 / "eval_speed" / "README.md", "One H200: transformers and vLLM"),
         (H100 / "eval_speed" / "README.md", "One H100: SGLang, vLLM and transformers"),
         (RESULTS / "eval_speed_cpu" / "eval_speed.md", "This project's 2-core CPU: transformers and llama.cpp")))


def h200_table(name: str, command: str) -> list[str]:
    md = H200 / f"{name}.md"
    if not md.exists():
        return [f"Missing h200/{name}.md.", ""]
    return [_body(md), "", command, ""]


def build() -> Path:
    lines = ["# Benchmark results", "",
             "Everything here is re-runnable: `make bench` (= `python bench/run.py all`: quality, GGUF "
             "conversion and GGUF importance matrices of both reference models on a CPU) and `make bench-gpu` "
             "(= `python bench/quantize_cost.py --shape 8b`, an H200). Each "
             "result's JSON file holds its command, machine, library versions and date (the files under h200/ and "
             "h100/ came from the commands named below and in each folder's README, run on an H200 or an H100).", "",
             "## 1. Quantization cost: quantkit vs llm-compressor directly", "", *quantize_cost(),
             "## 2. Quality on the reference model (CPU)", "", *quality(),
             "## 3. Serving in vLLM 0.26 on an H200", "", *serve_speed(),
             "### Every compressed-tensors format loaded in vLLM", "",
             *h200_table("vllm_matrix", "Command: one offline vLLM load per artifact (vLLM 0.26.0, enforce_eager, "
                                        "greedy decode) on one H200, by a script since folded into "
                                        "`scripts/gpu_cases.py --only tiny,legacy`, whose load step measures the same "
                                        "(results.md); file h200/vllm_matrix.json."),
             "### Served by `quantkit smoke` (a real `vllm serve`)", "",
             *h200_table("gpu_smoke", "Command: `quantkit smoke ARTIFACT --engine vllm` of awq-w4g128 and fp8-static "
                                      "on one H200, with doctor's prediction beside, by a script since folded into "
                                      "`scripts/gpu_cases.py --only awq-w4g128,fp8-static` (its smoke step and "
                                      "`doctor agrees` check); file h200/gpu_smoke.json."),
             "### vLLM vs transformers: the same artifacts scored by both engines", "", *eval_agreement(),
             "### Quantization time of the reference model on the H200", "", *quantize_tiny(),
             "## 4. GGUF conversion (CPU)", "", *gguf(),
             "## 5. Mixture of experts: Qwen3-30B-A3B's width, 12 layers, random weights (H200)", "", *moe(),
             "", "## 6. GGUF importance matrices (CPU)", "", *gguf_imatrix(),
             "", "## 7. Two H200s: distributed calibration and tensor-parallel serving", "", *two_gpus(),
             "", "## 8. Qwen2.5-32B's width on one H200 (h200/wide/README.md)", "", *wide(),
             "", "## 9. Serving at several concurrencies against bf16 (bench/serve_bench.py)", "", *serve_bench(),
             "", "## 10. Evaluation speed: scored tokens per second (bench/eval_speed.py)", "", *eval_speed()]
    out = RESULTS / "README.md"
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


if __name__ == "__main__":
    print(build())
