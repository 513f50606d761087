"""4-bit recipes on the real model (issue 25): every W4A16 method quantkit makes, scored on the same held-out tokens.

    python bench/quality_4bit.py                       # SmolLM2-135M-Instruct, 32 x 512 calibration, 8,192 tokens
    python bench/quality_4bit.py --only rtn,gptq       # some rows (the others kept from the last results file)
    python bench/quality_4bit.py --autoround-iterations 200 --samples 128   # on a machine with time (a GPU)
    python bench/quality_4bit.py --only awq --build-only &   # make rows in parallel, then score them in one run

Each row is made by the real CLI in a subprocess (``quantkit VERB MODEL OUT ... --json``, timed: the quantize wall
time includes process start, loading and saving), then every artifact is scored by one ``quantkit eval`` against the
bf16 model on the same tokens (transformers on the CPU for compressed-tensors, llama.cpp for GGUF). Each row gets two
bit counts: of the quantized linear layers (their packed weights, scales and zero points over their weights: what
the method spends where it quantizes) and of the whole file (the artifact's weight bytes over the source's
parameters, as ``quantkit eval`` counts it: bf16 embeddings included). Writes
bench/results/quality_4bit_<model>.{json,md}.

Artifacts are kept under ~/.cache/quantkit/bench/quality_4bit/<model>/ and reused when made with the same command
(``--force`` remakes them). torch runs with OMP_NUM_THREADS=1 unless the caller set it: on a shared 2-core machine
OpenMP threads spin-waiting on busy cores slow llm-compressor ten-fold.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

from quantkit.source import DTYPE_BYTES  # noqa: E402

DEFAULT_MODEL = "models/real/SmolLM2-135M-Instruct"
CACHE = Path.home() / ".cache" / "quantkit" / "bench" / "quality_4bit"
# name -> (what it is, verb, its own flags); calibration flags are added to every calibrating verb.
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    "rtn": ("RTN W4A16 (symmetric)", "rtn", []),
    "gptq": ("GPTQ W4A16, static act-order, min-max group ranges", "gptq", ["--no-imatrix"]),
    "gptq-no-actorder": ("GPTQ W4A16, no act-order", "gptq", ["--no-act-order", "--no-imatrix"]),
    "gptq-imatrix": ("GPTQ W4A16, static act-order, imatrix_mse observer (quantkit's default)", "gptq", ["--imatrix"]),
    "awq": ("AWQ W4A16 (asymmetric)", "awq", []),
    "autoround": ("AutoRound W4A16 (symmetric)", "autoround", []),
    "gguf": ("llama.cpp Q4_K_M, no imatrix", "gguf", ["-t", "Q4_K_M"]),
    "gguf-imatrix": ("llama.cpp Q4_K_M with imatrix", "gguf", ["-t", "Q4_K_M", "--imatrix"]),
}
CALIBRATES = {"gptq", "awq", "autoround"}
# GGUF tensors of the decoder blocks' linear layers (what W4A16 quantizes)
_GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}


def build(name: str, model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Make one artifact through the CLI (or reuse the one made by the same command); its argv and wall time."""
    label, verb, flags = VARIANTS[name]
    out = work / name
    argv = [sys.executable, "-m", "quantkit", verb, str(model), str(out), *flags]
    if verb in CALIBRATES or "--imatrix" in flags:
        argv += ["--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    if verb == "autoround":
        argv += ["--iterations", str(args.autoround_iterations)]
        label += f", {args.autoround_iterations} tuning steps per layer"
    record = work / f"{name}.build.json"
    if not args.force and record.exists() and out.exists():
        done = json.loads(record.read_text())
        if done["argv"][1:] == argv[1:]:
            return done
    if out.exists():
        shutil.rmtree(out)
    print(f"== {name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([*argv, "--json"], cwd=meta.ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    secs = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: quantkit {verb} failed with exit code {proc.returncode} (its messages are above)")
    done = {"name": name, "label": label, "argv": argv, "quantize_s": round(secs, 1)}
    record.write_text(json.dumps(done, indent=2))
    return done


def artifact_files(name: str, work: Path) -> list[Path]:
    """What ``quantkit eval`` scores for a row: the folder, or for GGUF its one quantized file."""
    out = work / name
    if VARIANTS[name][1] != "gguf":
        return [out]
    return sorted(p for p in out.glob("*.gguf") if "Q4_K_M" in p.name)


def layer_bits(path: Path) -> float:
    """Bits per weight of the quantized linear layers of the decoder blocks: their stored bytes (packed codes,
    scales, zero points, any g_idx) x 8 over their weights."""
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        tensors = [t for t in GGUFReader(str(path)).tensors if _GGUF_LINEAR.search(t.name)]
        return sum(int(t.n_bytes) for t in tensors) * 8 / sum(int(t.n_elements) for t in tensors)
    from safetensors import safe_open

    stored = weights = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for key in names:
                if not key.endswith(".weight_packed") or ".layers." not in key:
                    continue
                prefix = key.removesuffix(".weight_packed")
                rows, cols = st.get_tensor(f"{prefix}.weight_shape").tolist()
                weights += rows * cols
                for part in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"):
                    if f"{prefix}.{part}" in names:
                        t = st.get_slice(f"{prefix}.{part}")
                        n = 1
                        for d in t.get_shape():
                            n *= d
                        stored += n * DTYPE_BYTES[t.get_dtype()]
    return stored * 8 / weights


def group_size(path: Path) -> int | None:
    """The weight group size a compressed-tensors artifact's manifest records (None for GGUF)."""
    manifest = path / "quantkit.json"
    return json.loads(manifest.read_text())["quantization"].get("group_size") if path.is_dir() else None


def evaluate(files: list[Path], model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``quantkit eval`` of every artifact against the bf16 model on the same tokens."""
    argv = [sys.executable, "-m", "quantkit", "eval", *map(str, files), "--baseline", str(model), "--dataset",
            "heldout", "--max-tokens", str(args.tokens), "--ctx", str(args.ctx), "--device", "cpu",
            "--report-dir", str(work / "eval"), "--max-ppl-ratio", "100", "--max-kld", "100", "--min-top1", "0",
            "--json"]
    print(f"== eval: {len(files)} artifacts, {args.tokens} tokens", file=sys.stderr, flush=True)
    proc = subprocess.run(argv, cwd=meta.ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"quantkit eval failed with exit code {proc.returncode} (its messages are above)")
    return json.loads(proc.stdout)


def merged(rows: list[dict[str, Any]], previous: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """These rows, plus the rows of the last results file that were not remade, when it used the same model,
    calibration and tokens (scored on the same tokens, so the figures compare); in the table's order."""
    if not previous.exists():
        return rows
    old = json.loads(previous.read_text())
    same = all(old.get(k) == v for k, v in (("model", args.model), ("samples", args.samples),
                                             ("seq_len", args.seq_len), ("tokens", args.tokens), ("ctx", args.ctx)))
    made = {r["name"] for r in rows}
    kept = [r for r in old.get("rows", []) if same and r["name"] not in made and r["name"] in VARIANTS]
    return sorted(rows + kept, key=lambda r: list(VARIANTS).index(r["name"]))


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def markdown(h: dict[str, Any], data: dict[str, Any]) -> str:
    p = data["protocol"]
    lines = [f"# 4-bit recipes on {data['model']} (issue 25)", "", meta.md_header(h),
             f"Calibration: mixed, {data['samples']} x {data['seq_len']} tokens (gptq, awq, autoround, the GGUF "
             f"importance matrix). Evaluation: "
             f"{p.get('dataset')} split, ctx {p.get('ctx')}, {p.get('tokens_scored')} tokens scored, against the "
             f"bf16 model (ppl {_f(data.get('baseline_ppl'), '.3f')}); KLD is mean KL(bf16 || artifact) in nats per "
             "token, exact (full distributions). compressed-tensors scored by transformers on the CPU, GGUF by "
             "llama.cpp. Quantize time: the CLI's wall time on this machine, process start, loading and saving "
             "included. Group: quantkit's automatic group size (128, or 64 where 128 does not divide a layer's input "
             "width); GGUF types choose their own blocks.", "",
             "| artifact | group | bits/weight (quantized layers) | bits/weight (whole file) | KLD | top-1 | ppl ratio "
             "| quantize time |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        lines.append(f"| {r['label']} | {r.get('group_size') or '-'} | {_f(r.get('layer_bits'), '.3f')} | "
                     f"{_f(r.get('bits_per_weight'), '.2f')} | "
                     f"{_f(r.get('kld'), '.4f')} | {_f(r.get('top1'), '.4f')} | {_f(r.get('ppl_ratio'), '.4f')} | "
                     f"{_f(r.get('quantize_s'), '.0f')} s |")
    for note in data.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"source checkpoint folder [default: {DEFAULT_MODEL}]")
    ap.add_argument("--only", default=",".join(VARIANTS), help="comma-separated rows to make and score")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--autoround-iterations", type=int, default=200)
    ap.add_argument("--note", action="append", default=[], help="a line for the results file (repeatable)")
    ap.add_argument("--force", action="store_true", help="remake artifacts made before with the same command")
    ap.add_argument("--build-only", action="store_true", help="make the artifacts and stop (several of these can run "
                    "at once; a later run without it reuses them and scores them all on the same tokens)")
    args = ap.parse_args(argv)
    model = (meta.ROOT / args.model).resolve()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(VARIANTS)}")
    work = CACHE / model.name
    work.mkdir(parents=True, exist_ok=True)
    h = meta.header()
    builds = {n: build(n, model, work, args) for n in names}
    if args.build_only:
        return {"builds": builds}
    files = {n: artifact_files(n, work) for n in names}
    empty = [n for n, f in files.items() if not f]
    if empty:
        raise SystemExit(f"no Q4_K_M file in {', '.join(str(work / n) for n in empty)}")
    report = evaluate([f for n in names for f in files[n]], model, work, args)
    by_path = {str(Path(r["path"]).resolve()): r for r in report["results"]}
    rows = []
    for n in names:
        r = by_path[str(files[n][0].resolve())]
        rows.append({"name": n, "label": builds[n]["label"], "argv": builds[n]["argv"][2:],
                     "quantize_s": builds[n]["quantize_s"], "layer_bits": layer_bits(files[n][0]),
                     "bits_per_weight": r.get("bits_per_weight"), "size_bytes": r.get("size_bytes"),
                     "kld": r.get("kld"), "top1": r.get("top1"), "ppl": r.get("ppl"), "ppl_ratio": r.get("ppl_ratio"),
                     "engine": (r.get("engine") or {}).get("engine"), "group_size": group_size(files[n][0])})
    slug = re.sub(r"[^a-z0-9]+", "", model.name.lower().split("-")[0]) or "model"
    rows = merged(rows, meta.RESULTS / f"quality_4bit_{slug}.json", args)
    data = {"model": args.model, "samples": args.samples, "seq_len": args.seq_len, "tokens": args.tokens,
            "ctx": args.ctx, "autoround_iterations": args.autoround_iterations,
            "protocol": report.get("protocol") or {}, "baseline_ppl": (report.get("baseline") or {}).get("ppl"),
            "rows": rows,
            "notes": args.note}
    meta.write(f"quality_4bit_{slug}", {**h, **data}, markdown(h, data))
    print(markdown(h, data))
    return data


if __name__ == "__main__":
    main()
