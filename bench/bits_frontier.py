"""Bits per weight against KLD on the real model (issues 25, 40): every 4-bit recipe, FP4 and bits target, same tokens.

    python bench/bits_frontier.py            # reads the committed results, writes bench/results/bits_frontier_smollm2.*

Inputs, all committed:

* ``bench/results/h200/bits/``: the H200 run of ``scripts/gpu_cases.py --only bits`` (SmolLM2-135M-Instruct, every
  artifact made by the CLI with its default 128 x 512 calibration, scored by ``quantkit eval`` in vLLM and, exactly,
  in transformers on the GPU), the GPTQ ``--imatrix --target-bits`` sweep, and each artifact's measured bits
  (``artifacts.json``, from the manifests);
* ``bench/results/h200/bits/gguf_cpu_eval.json``: llama.cpp's Q4_K_M with and without an importance matrix (the
  same 128 x 512 calibration) scored by llama.cpp on this machine's CPU on the same 32,768 held-out tokens (ctx 2048)
  against the same bf16 model, with the bits of its block matrices counted from the file;
* ``bench/results/h200/bits_g32a/``: GPTQ ``--group-size 32 --asymmetric``, uniform and ``--target-bits 5.53``, the
  H200 run of ``scripts/gpu_cases.py --only g32a`` (made, served and scored like the ``bits`` cases);
* ``bench/results/h200/fp4/``: NVFP4 and MXFP4 (issue 40), the H200 run of ``scripts/gpu_cases.py --only fp4``: the
  verbs' defaults (served by vLLM and scored in both engines) and the algorithm x observer sweep (scored exactly in
  transformers on the GPU); the W4A4 artifacts' transformers rows are their emulated FP4 activations, vLLM's beside them
  weight-only (Hopper); bits counted from the files (``artifacts.json``, bench/fp4_bits.py);
* ``bench/results/cpu_bits_g32a/``: the same layout at --target-bits 5.0, 5.53 and 6.0, made and scored (exactly,
  transformers) on this repository's 2-core CPU machine on the same tokens, against the bf16 model run there (ppl
  8.357).

Every KLD here is exact (full distributions): transformers for compressed-tensors (vLLM's top-20 figures are a lower
bound, listed beside), llama.cpp for GGUF. Writes bench/results/bits_frontier_smollm2.{md,json,png}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

BITS = meta.ROOT / "bench" / "results" / "h200" / "bits"
OUT = meta.ROOT / "bench" / "results" / "bits_frontier_smollm2"
CPU_G32A = meta.ROOT / "bench" / "results" / "cpu_bits_g32a"
CPU_G32A_TARGETS = ("5.0", "5.53", "6.0")  # its quantkit-bT.json and eval-bT.json
G32A = meta.ROOT / "bench" / "results" / "h200" / "bits_g32a"
FP4 = meta.ROOT / "bench" / "results" / "h200" / "fp4"
G32A_LABELS = {"smollm2-gptq-g32a": "GPTQ --group-size 32 --asymmetric",
               "smollm2-gptq-g32a-b5.53": "GPTQ --group-size 32 --asymmetric --target-bits 5.53"}
LABELS = {"smollm2-gptq-imatrix": "GPTQ W4A16 --imatrix", "smollm2-autoround": "AutoRound W4A16 (200 steps)",
          "smollm2-gptq-imatrix-b5.53": "GPTQ --imatrix --target-bits 5.53",
          "smollm2-awq-b5.53-rerun": "AWQ --target-bits 5.53", "smollm2-rtn-b5.53": "RTN --target-bits 5.53"}


def _load(name: str) -> Any:
    return json.loads((BITS / name).read_text())


def _row(artifact: str, engine: str, bits: float, scores: dict[str, Any], family: str, quantize_s: float | None,
         kld_vllm: float | None = None, **extra: Any) -> dict[str, Any]:
    """One row of the table: ``scores`` is the exact evaluation (kld, top1, ppl_ratio) of the engine named."""
    return {"artifact": artifact, "engine": engine, "bits": bits, "kld": scores["kld"], "top1": scores["top1"],
            "ppl_ratio": scores["ppl_ratio"], "kld_vllm_top20": kld_vllm, "quantize_s": quantize_s, **extra,
            "family": family}


def _served(artifact: str, case: dict[str, Any], bits: float, quantize_s: float, family: str) -> dict[str, Any]:
    """A GPU case's row: scored exactly by transformers on the GPU, vLLM's top-20 bound beside it."""
    return _row(artifact, "transformers (vLLM loads and serves it)", bits, case["eval_transformers"], family,
                quantize_s, case["eval"].get("kld"))


def rows() -> list[dict[str, Any]]:
    """One row per artifact: what it is, its bits, its exact KLD, top-1, ppl ratio (and vLLM's bound when served)."""
    made = _load("artifacts.json")
    cases = {c["name"]: c for c in _load("gpu_cases.json")["cases"]}
    cases |= {c["name"] + "-rerun": c for c in _load("gpu_cases_awq_rerun.json")["cases"]}
    out = [_served(label, cases[name], made[name]["measured_bits"], made[name]["total_s"],
                   "gptq-sweep" if "gptq-imatrix" in name else name) for name, label in LABELS.items()]
    plans = _load("gptq_imatrix_sweep_plans.json")
    for r in _load("gptq_imatrix_sweep_eval.json")["results"]:
        plan = plans[r["path"]]
        out.append(_row(f"GPTQ --imatrix --target-bits {r['path'].rsplit('-b', 1)[1]}", "transformers",
                        plan["mixed"]["measured_bits"], r, "gptq-sweep", plan["timings"]["total"]))
    g32a = json.loads((G32A / "artifacts.json").read_text())
    for c in json.loads((G32A / "gpu_cases.json").read_text())["cases"]:
        made_here = g32a[c["name"]]
        out.append(_served(G32A_LABELS[c["name"]], c, made_here["measured_bits"], made_here["timings"]["total"],
                           "gptq-g32a-gpu"))
    for target in CPU_G32A_TARGETS:
        plan = json.loads((CPU_G32A / f"quantkit-b{target}.json").read_text())
        ev = json.loads((CPU_G32A / f"eval-b{target}.json").read_text())["results"][0]
        out.append(_row(f"GPTQ --group-size 32 --asymmetric --target-bits {target}, CPU run", "transformers (CPU)",
                        plan["quantization"]["mixed"]["measured_bits"], ev, "gptq-g32a", plan["timings"]["total"],
                        quantize_on="2-core CPU"))
    out += [_row(r["label"], "llama.cpp (CPU)", r["bits"], r, "gguf", None)
            for r in _load("gguf_cpu_eval.json")["results"]]
    return sorted(out + fp4_rows(), key=lambda r: (r["bits"], r["kld"]))


def _fp4_label(name: str) -> str:
    """``smollm2-nvfp4-gptq-mse`` -> ``NVFP4 W4A16 --algorithm gptq --observer mse``; the verbs' defaults named so."""
    parts = name.removeprefix("smollm2-").split("-")
    fmt = parts[0].upper()
    if len(parts) == 3:
        return f"{fmt} W4A16 --algorithm {parts[1]} --observer {parts[2]}"
    if parts[-1] == "w4a4":
        return f"{fmt} --scheme w4a4 (defaults), FP4 activations emulated"
    return f"{fmt} W4A16 (the verb's defaults: gptq, mse)"


def fp4_rows() -> list[dict[str, Any]]:
    """The FP4 cases of the real model scored exactly in transformers (bits: the format's, counted from the files)."""
    bits = json.loads((FP4 / "artifacts.json").read_text())
    out = []
    for case in json.loads((FP4 / "gpu_cases.json").read_text())["cases"]:
        name = case["name"]
        if not name.startswith("smollm2-") or "modelopt" in name or not case.get("eval_transformers"):
            continue
        fmt = name.split("-")[1]
        w4a4 = name.endswith("-w4a4")
        engine = "transformers, FP4 activations emulated (vLLM: weight-only)" if w4a4 else "transformers"
        vllm = (case.get("eval") or {}).get("kld")
        out.append(_row(_fp4_label(name), engine, bits[fmt]["measured_bits"], case["eval_transformers"],
                        f"fp4-{fmt}-w4a4" if w4a4 else f"fp4-{fmt}", None, vllm))
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["# Bits per weight against KLD: SmolLM2-135M-Instruct (issues 25 and 40)", "",
             f"- command: `python bench/bits_frontier.py` (inputs: {BITS.relative_to(meta.ROOT)}/, "
             f"{G32A.relative_to(meta.ROOT)}/, {FP4.relative_to(meta.ROOT)}/ and {CPU_G32A.relative_to(meta.ROOT)}/, "
             "see their READMEs)",
             "- tokens: 32,768 held-out (ctx 2048), exact KLD against the bf16 model (ppl 8.364; 8.357 run by "
             "transformers on the CPU, the baseline of the \"transformers (CPU)\" row)",
             "- bits: of the quantized linear layers (compressed-tensors: packed values, scales, zero points; GGUF: "
             "the block matrices' tensor bytes), counted from the files", "",
             "| artifact | scored by | bits/weight | KLD | top-1 | ppl ratio | vLLM KLD (top-20 bound) "
             "| quantize s (H200) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in table:
        vllm = f"{r['kld_vllm_top20']:.4f}" if r["kld_vllm_top20"] is not None else "-"
        secs = f"{r['quantize_s']:.0f}" if r["quantize_s"] is not None else "-"
        if r.get("quantize_on"):
            secs += f" ({r['quantize_on']})"
        lines.append(f"| {r['artifact']} | {r['engine']} | {r['bits']:.3f} | {r['kld']:.4f} | {r['top1']:.3f} | "
                     f"{r['ppl_ratio']:.3f} | {vllm} | {secs} |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.5), dpi=110)
    sweep = sorted((r for r in table if r["family"] == "gptq-sweep"), key=lambda r: r["bits"])
    ax.plot([r["bits"] for r in sweep], [r["kld"] for r in sweep], "o-",
            label="GPTQ --imatrix group 64 symmetric (--target-bits)")
    cpu = sorted((r for r in table if r["family"] == "gptq-g32a"), key=lambda r: r["bits"])
    ax.plot([r["bits"] for r in cpu], [r["kld"] for r in cpu], "D--",
            label="GPTQ g32 asymmetric (--target-bits), CPU runs")
    for fam, marker, label in (("fp4-nvfp4", "*", "NVFP4 W4A16 (algorithm x observer)"),
                               ("fp4-mxfp4", "h", "MXFP4 W4A16 (algorithm x observer)")):
        pts = [r for r in table if r["family"] == fam]
        if pts:
            best = min(pts, key=lambda r: r["kld"])
            ax.plot([r["bits"] for r in pts], [r["kld"] for r in pts], marker, alpha=0.5, label=label)
            ax.annotate(f"{best['kld']:.4f}", (best["bits"], best["kld"]), fontsize=7)
    for fam, marker, label in (("gguf", "s", None), ("smollm2-autoround", "^", None),
                               ("smollm2-awq-b5.53-rerun", "v", None), ("smollm2-rtn-b5.53", "x", None),
                               ("gptq-g32a-gpu", "P", None)):
        for r in (r for r in table if r["family"] == fam):
            ax.plot(r["bits"], r["kld"], marker, label=label or r["artifact"])
    ax.set_xlabel("bits per weight of the quantized layers (from the files)")
    ax.set_ylabel("KLD vs bf16 (nats/token, exact)")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M-Instruct, 32,768 held-out tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no point hidden
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    table = rows()
    OUT.with_suffix(".json").write_text(json.dumps({"rows": table}, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(table))
    plot(table, OUT.with_suffix(".png"))
    print(markdown(table))


if __name__ == "__main__":
    main()
