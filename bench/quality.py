"""Quality benchmark (issue 10 item 2, issue 14 item 5): every method on a reference model, on its held-out split.

    python bench/quality.py                # the full recipe, bench/recipes/quality.yaml (models/quantkit-tiny)
    python bench/quality.py --model moe    # bench/recipes/quality-moe.yaml (models/quantkit-tiny-moe)
    python bench/quality.py --quick        # 8 x 256 calibration tokens, 8192 scored tokens, three GGUF types

Runs the real CLI, ``quantkit run RECIPE --json``, in a subprocess (as a user would), then tabulates its report:
perplexity, perplexity ratio, KL divergence and top-1 agreement against the bf16 source, size and bits per weight,
and for AWQ and GPTQ the share of RTN's gap they close. Writes bench/results/quality.{json,md} (``--model moe``:
quality_moe) and copies the size-vs-perplexity plot beside it (``--quick`` writes under bench/results/quick/).

torch's OpenMP threads spin-wait on busy cores, which on a shared 2-core machine slows the run ten-fold, so
the subprocess runs with OMP_NUM_THREADS=1 unless the caller set it. Tested with quantkit's spine on torch 2.13,
llm-compressor 0.14, transformers 5.17, llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

RECIPES = {"dense": meta.ROOT / "bench" / "recipes" / "quality.yaml",
           "moe": meta.ROOT / "bench" / "recipes" / "quality-moe.yaml"}
NAMES = {"dense": "quality", "moe": "quality_moe"}
QUICK = {"calibration": {"samples": 8, "seq_len": 256}, "evaluation": {"max_tokens": 8192},
         "gguf_types": ["F16", "Q8_0", "Q4_K_M"], "output": "out/bench-quality-quick"}
PLOT = "size-vs-ppl.png"
AWQ_PAPER = ("AWQ paper (Lin et al., 2024, Table 4): on Llama-2-7B, INT4 g128 WikiText-2 perplexity FP16 5.47, RTN "
             "5.73, GPTQ 5.69, GPTQ with reordering 5.63, AWQ 5.60: AWQ closes about half of RTN's gap (0.13 of 0.26), "
             "GPTQ 15% (38% with reordering; quantkit's GPTQ uses llm-compressor's static activation order).")


def quick_recipe(recipe: Path, folder: Path) -> Path:
    """The bench recipe shrunk for a fast check, written to a temporary file (same methods, fewer tokens)."""
    import yaml

    data = yaml.safe_load(recipe.read_text())
    data["output"] = QUICK["output"]
    data["calibration"].update(QUICK["calibration"])
    data["evaluation"].update(QUICK["evaluation"])
    for o in data["outputs"]:
        if o["method"] == "gguf":
            o["types"] = QUICK["gguf_types"]
    path = folder / "quality-quick.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_quantkit(recipe: Path, force: bool) -> tuple[dict[str, Any], list[str], float]:
    """``quantkit run RECIPE --json`` in the repository root; its JSON report, the argv and the wall time."""
    argv = [sys.executable, "-m", "quantkit", "run", str(recipe), "--json"] + (["--force"] if force else [])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=meta.ROOT, env=env, stdout=subprocess.PIPE, text=True)
    secs = time.monotonic() - t0
    if proc.returncode not in (0, 3):  # 3 = a gate failed; the bench recipe sets none, but figures still stand
        raise SystemExit(f"quantkit run failed with exit code {proc.returncode} (its messages are above)")
    return json.loads(proc.stdout), argv, secs


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per scored model: the baseline first, then each artifact (one per GGUF file)."""
    out: list[dict[str, Any]] = []
    for o in report["outputs"]:
        ev = o.get("evaluation") or {}
        if not out and ev.get("baseline_ppl"):
            out.append({"name": "bf16 (source)", "method": "baseline", "ppl": ev["baseline_ppl"], "ppl_ratio": 1.0,
                        "kld": 0.0, "top1": 1.0, "size_bytes": None, "bits_per_weight": None})
        for x in sorted(ev.get("results") or [], key=lambda x: -(x.get("size_bytes") or 0)):  # GGUF: F16 first
            name = o["name"] if not x.get("file") else x["file"].removesuffix(".gguf").rsplit("-", 1)[-1]
            out.append({"name": name if o["method"] != "gguf" else f"gguf {name}", "method": o["method"],
                        "status": o["status"], "ppl": x["ppl"], "ppl_ratio": x["ppl_ratio"], "kld": x["kld"],
                        "kld_p99": x.get("kld_p99"), "top1": x["top1"], "size_bytes": x["size_bytes"],
                        "bits_per_weight": x["bits_per_weight"], "engine": (x.get("engine") or {}).get("engine"),
                        "build_s": ((o.get("timings") or {}).get("total")), "eval_s": x.get("seconds"),
                        "kld_method": x.get("kld_method")})
    return out


def source_size(model: str) -> dict[str, Any]:
    """The bf16 source's bytes and bits per weight, counted the way the evaluation counts an artifact's."""
    from quantkit.recipe import ModelSpec
    from quantkit.source import resolve

    src = resolve(ModelSpec(source=str(meta.ROOT / model)))
    return {"size_bytes": src.size_bytes, "bits_per_weight": src.size_bytes * 8 / src.num_parameters}


def outside_blocks(model: str) -> float:
    """Share of the source's parameters outside its decoder blocks (embeddings, an untied lm_head, the final norm),
    read from the safetensors headers."""
    from quantkit.recipe import ModelSpec
    from quantkit.source import resolve, safetensors_header

    src = resolve(ModelSpec(source=str(meta.ROOT / model)))
    outside = 0
    for f in src.weight_files:
        header, _ = safetensors_header(f)
        for name, info in header.items():
            if name != "__metadata__" and ".layers." not in name:
                start, stop = info["data_offsets"]
                outside += (stop - start) // 2
    return outside / src.num_parameters


def gap_closed(table: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Share of RTN's gap that AWQ and GPTQ close, on KLD and on perplexity (1 = as good as the source)."""
    by = {r["method"]: r for r in table if r["method"] in ("baseline", "rtn", "awq", "gptq")}
    rtn, base = by.get("rtn"), by.get("baseline")
    out: dict[str, dict[str, float | None]] = {}
    if not rtn or not base:
        return out
    for m in ("awq", "gptq"):
        if m not in by:
            continue
        kld_gap, ppl_gap = rtn["kld"], rtn["ppl"] - base["ppl"]
        out[m] = {"kld": (rtn["kld"] - by[m]["kld"]) / kld_gap if kld_gap > 0 else None,
                  "ppl": (rtn["ppl"] - by[m]["ppl"]) / ppl_gap if ppl_gap > 0 else None}
    return out


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def markdown(h: dict[str, Any], data: dict[str, Any]) -> str:
    """The results table, the gap-closed table and how they were made."""
    p = data["protocol"]
    lines = [f"# Quality on the reference model ({data['model']}, held-out split)", "",
             meta.md_header(h),
             f"Recipe: `{data['recipe']}`. Calibration: {data['calibration']}. Evaluation: {p.get('dataset')} split, "
             f"ctx {p.get('ctx')}, {p.get('windowing')} windows, {p.get('tokens_scored')} tokens scored of "
             f"{p.get('stream_tokens')}; KLD is mean KL(source || artifact) in nats/token ({data['kld_method']}). "
             f"compressed-tensors artifacts scored with transformers on CPU, GGUF with llama.cpp.", "",
             "| output | ppl | ppl ratio | KLD | KLD p99 | top-1 | size | bits/weight |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        size = f"{r['size_bytes'] / 2**20:.2f} MiB" if r.get("size_bytes") else "-"
        lines.append(f"| {r['name']} | {_f(r['ppl'], '.3f')} | {_f(r['ppl_ratio'], '.4f')} | {_f(r['kld'], '.5f')} | "
                     f"{_f(r.get('kld_p99'), '.4f')} | {_f(r['top1'], '.4f')} | {size} | "
                     f"{_f(r.get('bits_per_weight'), '.2f')} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | - | - | - | - | - | - | - |")
    if data.get("skipped"):
        lines += [""] + [f"{name}: evaluation skipped: {why}" for name, why in data["skipped"].items()]
    lines += ["", "Bits per weight = artifact bytes x 8 / source parameters (embeddings and an unquantized lm_head "
              f"included: {data['outside_blocks']:.0%} of this small model's parameters, which is why its W4 artifacts "
              "sit far above 4). GGUF types quantize the embeddings and output matrix too, so they are smaller at the "
              "same weight bits.",
              "",
              "## Share of RTN's gap closed (W4 g128)", "",
              "gap closed = (RTN - method) / (RTN - source), on KLD (source = 0) and on perplexity.", "",
              "| method | on KLD | on ppl |", "|---|---|---|"]
    for m, g in data["gap_closed"].items():
        lines.append(f"| {m} | {_f(g['kld'], '.0%')} | {_f(g['ppl'], '.0%')} |")
    lines += ["", AWQ_PAPER, "", f"![size vs perplexity]({data['plot']})" if data.get("plot") else "", ""]
    if data.get("reused"):
        lines += [f"Outputs reused from an earlier run of the same recipe (same source, versions and settings): "
                  f"{', '.join(data['reused'])}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fast check: fewer tokens and GGUF types")
    ap.add_argument("--force", action="store_true", help="rebuild every output instead of reusing complete ones")
    ap.add_argument("--model", choices=sorted(RECIPES), default="dense",
                    help="dense: models/quantkit-tiny; moe: models/quantkit-tiny-moe")
    args = ap.parse_args(argv)
    h = meta.header()
    folder = meta.RESULTS / "quick" if args.quick else meta.RESULTS
    import yaml

    full = RECIPES[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        recipe = quick_recipe(full, Path(tmp)) if args.quick else full
        spec = yaml.safe_load(recipe.read_text())
        cal = spec["calibration"]
        report, qk_argv, secs = run_quantkit(recipe, args.force)
    table = rows(report)
    if table and table[0]["method"] == "baseline":
        table[0].update(source_size(spec["model"]["source"]))
    ev = next((o["evaluation"] for o in report["outputs"] if o.get("evaluation")), {})
    data = {"model": spec["model"]["source"],
            "recipe": str(full.relative_to(meta.ROOT)) + (" (--quick: shrunk)" if args.quick else ""),
            "quantkit_command": "OMP_NUM_THREADS=1 quantkit run " + (
                "(the shrunk recipe)" if args.quick else str(full.relative_to(meta.ROOT))) + " --json",
            "calibration": f"{cal.get('dataset', 'mixed')}, {cal.get('samples')} x {cal.get('seq_len')} tokens",
            "protocol": ev.get("protocol") or {}, "kld_method": next((r["kld_method"] for r in table if r.get("kld_method")),
                                                                "exact: full distributions on both sides"),
            "seconds": round(secs, 1), "rows": table, "gap_closed": gap_closed(table),
            "reused": [o["name"] for o in report["outputs"] if o["status"] == "reused"], "plot": None,
            "skipped": {o["name"]: (o.get("evaluation") or {}).get("summary") for o in report["outputs"]
                        if (o.get("evaluation") or {}).get("status") == "skipped"},
            "outside_blocks": outside_blocks(spec["model"]["source"])}
    src = meta.ROOT / report["release"] / PLOT
    if src.exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, folder / f"{NAMES[args.model]}.png")
        data["plot"] = f"{NAMES[args.model]}.png"
    meta.write(NAMES[args.model], {**h, **data}, markdown(h, data), folder)
    print(markdown(h, data))
    return data


if __name__ == "__main__":
    main()
