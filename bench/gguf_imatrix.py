"""GGUF importance matrices on a reference model (issue 15 item 5): size and KLD with and without one, and its cost.

    python bench/gguf_imatrix.py               # 64 x 512 calibration tokens, 65,536 held-out tokens at ctx 2048
    python bench/gguf_imatrix.py --model moe   # the same on models/quantkit-tiny-moe (per-expert matrices)
    python bench/gguf_imatrix.py --quick       # 16 x 256 calibration tokens, 8,192 held-out tokens

1. Quality. Q2_K, Q3_K_M, Q4_K_S, Q4_K_M, IQ4_XS, IQ3_M and IQ2_M are made by ``quantkit gguf`` from the reference
   model (``--model dense``: models/quantkit-tiny; ``moe``: models/quantkit-tiny-moe, Qwen3-MoE with 8 experts)
   twice, without and with an importance matrix computed from the calibration set (``mixed``, the same protocol
   as bench/quality.py; IQ2_M cannot be made without one), and scored by ``quantkit eval`` against the bf16 source
   on the held-out split: size, bits per weight, perplexity ratio, KLD, top-1. The goals: the matrix lowers KLD for
   every K-quant at 4 bits and below; IQ4_XS is smaller than Q4_K_M and within 1.1x of imatrix Q4_K_M's KLD.
2. Cost. The time to compute the matrix in quantkit (transformers, forward pre-hooks, model load included) against
   ``llama-imatrix`` run directly (process start and model load included) on the same tokens: a text that
   llama.cpp tokenizes into chunks whose ids quantkit is given (the way tests/test_gguf_imatrix.py checks the two
   agree), from the F16 GGUF as a llama.cpp user would run it. The two matrices are compared as well (for the MoE
   model: the tokens the router sent to each expert, and each expert's sums).

Writes bench/results/gguf_imatrix.{json,md} (``--model moe``: gguf_imatrix_moe; ``--quick``: under
bench/results/quick/). CPU only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

sys.path.insert(0, str(meta.ROOT))
MODELS = {"dense": meta.ROOT / "models" / "quantkit-tiny", "moe": meta.ROOT / "models" / "quantkit-tiny-moe"}
NAMES = {"dense": "gguf_imatrix", "moe": "gguf_imatrix_moe"}
TITLES = {"dense": "the reference model", "moe": "the MoE reference model"}
TYPES = ["Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_XS", "IQ3_M", "IQ2_M"]
K_QUANTS = ["Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M"]
FULL = {"samples": 64, "seq_len": 512, "max_tokens": 65536, "ctx": 2048}
QUICK = {"samples": 16, "seq_len": 256, "max_tokens": 8192, "ctx": 2048}


def make(model: Path, out: Path, types_: list[str], with_imatrix: bool, size: dict[str, int]) -> tuple[Any, float]:
    from quantkit import api, recipe
    from quantkit.formats.specs import GgufSpec

    r = recipe.load(None, {"model.source": str(model), "output": str(out), "calibration.dataset": "mixed",
                           "calibration.samples": size["samples"], "calibration.seq_len": size["seq_len"]},
                    base={"quantize": {"method": "gguf", "types": ["Q4_K_M"]}})
    spec = GgufSpec(method="gguf", types=types_, imatrix=with_imatrix)
    t0 = time.perf_counter()
    res = api.quantize_one(r, spec, out, force=True)
    return res, time.perf_counter() - t0


def mix(path: Path) -> dict[str, float]:
    """Share of a GGUF file's weights (2-D and stacked expert tensors) held in each ggml type: the quantizer's
    per-tensor mix."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(counts.values())
    return {k: round(v / total, 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def outside_blocks(path: Path) -> float:
    """Share of a GGUF file's parameters outside the transformer blocks (embeddings, output), which no importance
    matrix covers."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    return sum(int(t.n_elements) for t in tensors if not t.name.startswith("blk.")) / sum(
        int(t.n_elements) for t in tensors)


def quality(model: Path, tmp: Path, size: dict[str, int]) -> dict[str, Any]:
    from quantkit import api
    from quantkit.evaluation.evaluate import EvalOptions

    plain, t_plain = make(model, tmp / "plain", [t for t in TYPES if t != "IQ2_M"], False, size)
    imx, t_imx = make(model, tmp / "imatrix", TYPES, True, size)
    report = api.evaluate([plain.path, imx.path], str(model),
                          EvalOptions(dataset="heldout", ctx=size["ctx"], max_tokens=size["max_tokens"], write=False))
    rows: dict[str, dict[str, Any]] = {}
    for r in report.results:
        label = "imatrix" if r.target.path.parent == imx.path else "plain"
        t = r.target.path.stem.rsplit("-", 1)[-1]
        rows.setdefault(t, {"type": t})[label] = {
            "size_bytes": r.target.size_bytes, "bits_per_weight": r.bits_per_weight, "ppl": r.metrics.ppl,
            "ppl_ratio": r.ppl_ratio, "kld": r.metrics.kld, "top1": r.metrics.top1}
    for t in TYPES:
        rows[t]["mix"] = mix(imx.path / imx.manifest.quantization["files"][t])
    table = [rows[t] for t in TYPES]
    q4 = rows["Q4_K_M"]["imatrix"]
    goals = {
        "imatrix_lowers_kld_for_k_quants_at_4_bits_and_below": {
            t: rows[t]["imatrix"]["kld"] < rows[t]["plain"]["kld"] for t in K_QUANTS},
        "iq4_xs_smaller_than_q4_k_m": rows["IQ4_XS"]["imatrix"]["size_bytes"] < q4["size_bytes"],
        "iq4_xs_kld_over_imatrix_q4_k_m": rows["IQ4_XS"]["imatrix"]["kld"] / q4["kld"],
    }
    return {"protocol": report.protocol.manifest(), "baseline_ppl": report.baseline.metrics.ppl,
            "outside_blocks": outside_blocks(imx.path / imx.manifest.quantization["files"]["Q4_K_M"]),
            "imatrix": imx.manifest.quantization["imatrix"],
            "calibration": imx.manifest.calibration.model_dump(mode="json"),
            "quantize_seconds": {"plain": round(t_plain, 1), "imatrix": round(t_imx, 1),
                                 "imatrix_step": imx.manifest.timings.get("imatrix")},
            "rows": table, "goals": goals}


def cost(model: Path, tmp: Path, size: dict[str, int]) -> dict[str, Any]:
    """quantkit's matrix and llama-imatrix's on the same token chunks, timed."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from quantkit.producers.gguf import collect, convert, imatrix, tools
    from quantkit.progress import Reporter

    n, chunks = size["seq_len"], size["samples"]
    threads = torch.get_num_threads()  # llama-imatrix gets as many: the same CPU budget for both
    tok = AutoTokenizer.from_pretrained(model)
    docs = []
    for name in ("prose.jsonl.gz", "code.jsonl.gz"):
        with gzip.open(meta.ROOT / "calibration" / name, "rt", encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f if line.strip()]
    text = "\n\n".join(docs)
    ids = tok(text)["input_ids"]
    token_chunks = [[tok.bos_token_id, *ids[k * n + 1:(k + 1) * n]] for k in range(chunks)]
    (tmp / "text.txt").write_text(text, encoding="utf-8")

    plan = convert.plan(model)
    t0 = time.perf_counter()
    ours, how = collect.compute(model, plan, token_chunks, device="cpu", reporter=Reporter(quiet=True))
    t_ours = time.perf_counter() - t0

    f16, _ = make(model, tmp / "f16", ["F16"], False, size)
    gguf_f16 = f16.path / f16.manifest.quantization["files"]["F16"]
    out = tmp / "llama-imatrix.gguf"
    t0 = time.perf_counter()
    tools.run("llama-imatrix", ["-m", str(gguf_f16), "-f", str(tmp / "text.txt"), "-o", str(out), "-c", str(n),
                                "--chunks", str(chunks), "--no-ppl", "-t", str(threads)], purpose="the cost benchmark")
    t_theirs = time.perf_counter() - t0
    theirs = imatrix.read(out)
    # per matrix: the entry of a dense one, each expert's row of a stacked one
    rel = max(float((np.linalg.norm(ours.entries[k].sums - e.sums, axis=1)
                     / np.maximum(np.linalg.norm(e.sums, axis=1), 1e-12)).max()) for k, e in theirs.entries.items())
    return {"tokens": chunks * n, "chunks": chunks, "chunk_size": n, "threads": threads,
            "quantkit_seconds": round(t_ours, 2),
            "quantkit": how, "llama_imatrix_seconds": round(t_theirs, 2),
            "llama_imatrix": tools.describe_one("llama-imatrix"), "llama_imatrix_model": "F16 GGUF",
            "entries": len(theirs.entries), "same_entries": set(theirs.entries) == set(ours.entries),
            "count_difference_max": int(max(np.abs(ours.entries[k].counts - e.counts).max()
                                            for k, e in theirs.entries.items())),
            "experts_entries": sum(len(e.counts) > 1 for e in theirs.entries.values()),
            "max_relative_difference": rel}


def markdown(data: dict[str, Any]) -> str:
    q, c = data["quality"], data["cost"]
    p = q["protocol"]
    lines = [f"# GGUF importance matrices on {TITLES[data['model']]}", "", meta.md_header(data["provenance"]),
             f"Calibration: `{q['calibration']['dataset']}`, {q['calibration']['samples']} x "
             f"{q['calibration']['seq_len']} tokens (sha256 `{q['calibration']['tokens_sha256'][:16]}...`). "
             f"Scored on `{p['source']}`: {p['tokens_scored']:,} tokens, ctx {p['ctx']}; baseline perplexity "
             f"{q['baseline_ppl']:.3f}.", "",
             "| type | size | bits/weight | KLD | KLD with imatrix | ppl ratio | ppl ratio with imatrix | top-1 | "
             "top-1 with imatrix | weights by type |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in q["rows"]:
        a, b = r.get("plain"), r["imatrix"]
        shares = ", ".join(f"{k} {v:.0%}" for k, v in r["mix"].items())
        lines.append(f"| {r['type']} | {b['size_bytes'] / 2**20:.2f} MiB | {b['bits_per_weight']:.2f} | "
                     f"{_fig(a, 'kld', 5, 'needs a matrix')} | {b['kld']:.5f} | {_fig(a, 'ppl_ratio', 4)} | "
                     f"{b['ppl_ratio']:.4f} | {_fig(a, 'top1', 3)} | {b['top1']:.3f} | {shares} |")
    g = q["goals"]
    lowers = ", ".join(f"{t} {'yes' if ok else 'NO'}"
                       for t, ok in g["imatrix_lowers_kld_for_k_quants_at_4_bits_and_below"].items())
    lines += ["", f"Goals: the matrix lowers KLD for {lowers}; IQ4_XS smaller than Q4_K_M: "
                  f"{'yes' if g['iq4_xs_smaller_than_q4_k_m'] else 'NO'}; IQ4_XS KLD / imatrix Q4_K_M KLD = "
                  f"{g['iq4_xs_kld_over_imatrix_q4_k_m']:.3f} (goal <= 1.1).", "",
              "Sizes are with the matrix (the same type's file without one has the same size). Bits per weight count "
              f"every parameter, the embeddings and output ({q['outside_blocks']:.0%} of this model, which no matrix "
              "covers) included; the last column is llama.cpp's per-tensor mix of the file.", "",
              *_experts(q["imatrix"]),
              "## Cost of the matrix", "",
              f"Same {c['tokens']:,} tokens ({c['chunks']} chunks of {c['chunk_size']}), {c['entries']} entries, "
              f"{c['threads']} CPU thread(s) each:", "",
              "| computed by | on | seconds |", "| --- | --- | --- |",
              f"| quantkit (transformers {c['quantkit']['transformers']}, forward pre-hooks, model load included) | "
              f"{c['quantkit']['device']}, {c['quantkit']['dtype']} | {c['quantkit_seconds']:.2f} |",
              f"| llama-imatrix b{c['llama_imatrix'].get('build_number')} ({c['llama_imatrix'].get('commit')}), "
              f"process and model load included | CPU, {c['llama_imatrix_model']} | {c['llama_imatrix_seconds']:.2f} |",
              "", f"Largest relative difference between the two matrices, per matrix (per expert for the "
                  f"{c['experts_entries']} stacked expert entries): {c['max_relative_difference']:.2e} (quantkit's "
                  f"float32 activations against llama.cpp's on F16 weights); {_counts(c)}.", ""]
    return "\n".join(lines)


def _counts(c: dict[str, Any]) -> str:
    if not c["count_difference_max"]:
        return "token counts identical in every entry" + (", per expert" if c["experts_entries"] else "")
    return (f"per-expert token counts at most {c['count_difference_max']} apart (llama.cpp rounds activations to F16 "
            "for F16 weights, which moves a router's near-tie tokens to another expert; on the F32 file the counts "
            "are identical: tests/test_gguf_imatrix_moe.py)")


def _experts(record: dict[str, Any]) -> list[str]:
    """For an MoE model: how many calibration tokens the router sent to each expert (the matrix's counts)."""
    tokens = record.get("expert_tokens")
    if not tokens:
        return []
    per = "; ".join(f"layer {layer}: {', '.join(f'{n:,}' for n in counts)}"
                    for layer, counts in tokens["per_layer"].items())
    n = len(next(iter(tokens["per_layer"].values())))
    return [f"Calibration tokens the router sent to each expert (experts 0-{n - 1}; each expert's row of the matrix "
            f"sums over these tokens only): {per}.", ""]


def _fig(row: dict[str, Any] | None, key: str, digits: int, missing: str = "-") -> str:
    return f"{row[key]:.{digits}f}" if row else missing


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a check that the benchmark runs")
    ap.add_argument("--model", choices=sorted(MODELS), default="dense",
                    help="dense: models/quantkit-tiny; moe: models/quantkit-tiny-moe")
    args = ap.parse_args(argv)
    size = QUICK if args.quick else FULL
    model = MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="quantkit-bench-imatrix-") as tmp:
        data = {"provenance": meta.header(), "model": args.model, "sizes": size,
                "quality": quality(model, Path(tmp), size), "cost": cost(model, Path(tmp), size)}
    folder = meta.RESULTS / "quick" if args.quick else meta.RESULTS
    j, m = meta.write(NAMES[args.model], data, markdown(data), folder)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
