"""Scored tokens per second of each engine's evaluation, on the same tokens (issue 44 item 1).

    python bench/eval_speed.py --device cpu --tokens 4096 --engines transformers,llama.cpp \
        --out bench/results/eval_speed_cpu
    python bench/eval_speed.py --device cuda --tokens 32768 --engines transformers,vllm \
        --vllm-python VLLM_PY [--vllm-path DIR] --out bench/results/h200/eval_speed

The model (``--model``, SmolLM2-135M-Instruct by default) and a ``quantkit rtn`` artifact of it (a ``quantkit gguf``
F32 + Q8_0 artifact for llama.cpp), made once in ``--workdir``, are scored on the held-out text:

* ``transformers``: ``quantkit eval``'s path (batched windows, baseline kept on the device, KLD on the device), the
  baseline's pass and the artifact's, against the previous path measured the same way: one window per forward
  pass, full log-probabilities copied to the host and compared in numpy (``--no-previous`` skips it);
* ``vllm``: quantkit's scoring (``quantkit eval --engine vllm``: the worker's ``llm.generate`` with
  ``prompt_logprobs``, its conversion, the comparison on the baseline's device) against vLLM's own prompt-logprob
  throughput (the seconds inside ``llm.generate``, which the worker reports) and against the same windows run
  without ``prompt_logprobs`` (the forward passes alone: what bounds prompt log-probabilities);
* ``llama.cpp``: ``llama-perplexity --kl-divergence-base`` (the F32 file) then ``--kl-divergence`` (Q8_0) against
  quantkit's llama.cpp engine on the very tokens llama-perplexity scores (the second half of each chunk, read from
  its base file, BOS in front only where the file asks llama.cpp to add one, as llama-perplexity does), the F32
  file as baseline here too so only the two programs differ, and on quantkit's own protocol (every token of each
  window scored, BOS first).

vLLM runs in its own Python: ``--vllm-python`` (or ``QUANTKIT_VLLM_PYTHON``); ``--vllm-path DIR`` (repeatable) puts
folders of a ``pip install --target DIR`` on that Python's PYTHONPATH through a small wrapper script, as
``scripts/gpu_cases.py`` does. Results: ``eval_speed.json`` and ``eval_speed.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import meta  # noqa: E402

from quantkit.engines.logits import EngineOptions, Rows, Window, open_engine, scored_rows  # noqa: E402
from quantkit.evaluation import protocol  # noqa: E402
from quantkit.evaluation.evaluate import EvalOptions, evaluate  # noqa: E402
from quantkit.evaluation.metrics import Accumulator, BaselineStore, score_rows  # noqa: E402

MODEL = ROOT / "models" / "real" / "SmolLM2-135M-Instruct"


def quantkit(*args: Any) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "quantkit", *map(str, args), "--quiet"], cwd=ROOT, env=env, check=True)


def artifacts(model: Path, work: Path, gguf: bool) -> dict[str, Path]:
    """The RTN artifact (and the GGUF files), made once per workdir."""
    out = {"rtn": work / "rtn"}
    if not (out["rtn"] / "quantkit.json").is_file():
        quantkit("rtn", model, out["rtn"])
    if gguf:
        folder = work / "gguf"
        if not (folder / "quantkit.json").is_file():
            quantkit("gguf", model, folder, "-t", "F32", "-t", "Q8_0")
        files = json.loads((folder / "quantkit.json").read_text())["quantization"]["files"]
        out |= {t: folder / f for t, f in files.items()}
    return out


def figures(metrics: Any) -> dict[str, Any]:
    return {"ppl": metrics.ppl, "kld": metrics.kld, "top1": metrics.top1, "tokens": metrics.tokens}


# ---------------------------------------------------------------------------------------------------------------
# transformers


def transformers_part(model: Path, art: Path, args: argparse.Namespace) -> dict[str, Any]:
    report = evaluate([art], str(model), EvalOptions(dataset="heldout", ctx=args.ctx, max_tokens=args.tokens,
                                                     engine="transformers", device=args.device, write=False))
    base, res = report.baseline, report.results[0]
    out = {"kld_method": report.kld_method, "batch": res.engine.get("batch"),
           "baseline": {"scoring_s": base.engine["scoring_s"], "tokens_per_s": base.engine["scored_tokens_per_s"],
                        **figures(base.metrics)},
           "artifact": {"scoring_s": res.engine["scoring_s"], "tokens_per_s": res.engine["scored_tokens_per_s"],
                        **figures(res.metrics)}}
    if args.previous:
        out["previous"] = previous_path(model, art, report.protocol.windows, args)
    return out


def previous_path(model: Path, art: Path, windows: list[Window], args: argparse.Namespace) -> dict[str, Any]:
    """The path before issue 44: one window per forward pass, its full log-probabilities copied to the host, the
    baseline's kept as float16 numpy arrays and the comparison made in numpy (:func:`kld_rows`)."""
    opts = EngineOptions(ctx=args.ctx, device=args.device, batch=1)
    with tempfile.TemporaryDirectory() as tmp:
        store = BaselineStore(Path(tmp), sum(w.n_scored for w in windows))
        timing = {}
        for label, path in (("baseline", model), ("artifact", art)):
            engine = open_engine("transformers", path, opts)
            acc = Accumulator()
            t0 = time.perf_counter()
            for w, lp in zip(windows, engine.logits(windows), strict=True):
                if label == "baseline":
                    store.put(w, lp)
                    acc.add(w, lp)
                else:
                    acc.add(w, lp, store.get(w))
            secs = time.perf_counter() - t0
            engine.close()
            timing[label] = {"scoring_s": round(secs, 3), "tokens_per_s": round(acc.tokens / secs, 1),
                             **figures(acc.result())}
    return timing


# ---------------------------------------------------------------------------------------------------------------
# vLLM


def vllm_python(args: argparse.Namespace, work: Path) -> str | None:
    """vLLM's interpreter; with --vllm-path a wrapper script that puts those folders (only) on its PYTHONPATH."""
    python = args.vllm_python or os.environ.get("QUANTKIT_VLLM_PYTHON")
    if not args.vllm_path:
        return python
    wrapper = work / "vllm-python.sh"
    wrapper.write_text(f"#!/bin/sh\nexport PYTHONPATH={shlex.quote(os.pathsep.join(args.vllm_path))}\n"
                       f"exec {shlex.quote(python or sys.executable)} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def vllm_part(model: Path, art: Path, args: argparse.Namespace, python: str | None) -> dict[str, Any]:
    report = evaluate([art], str(model), EvalOptions(dataset="heldout", ctx=args.ctx, max_tokens=args.tokens,
                                                     engine="vllm", device="cuda", python=python, write=False))
    res, proto = report.results[0], report.protocol
    info = res.engine
    scored = proto.tokens_scored
    out = {"tokens_scored": scored, "tokens_run": proto.tokens_evaluated, "kld_method": res.kld_method,
           "quantkit_scoring_s": info["scoring_s"], "quantkit_tokens_per_s": info["scored_tokens_per_s"],
           "vllm_generate_s": info.get("vllm_generate_s"), "worker_convert_s": info.get("vllm_convert_s"),
           **figures(res.metrics)}
    if out["vllm_generate_s"]:
        out["vllm_prompt_logprobs_tokens_per_s"] = round(scored / out["vllm_generate_s"], 1)
        out["ratio"] = round(out["quantkit_scoring_s"] / out["vllm_generate_s"], 3)
    engine = open_engine("vllm", art, EngineOptions(ctx=args.ctx, device="cuda", python=python))
    try:
        prefill = engine.prefill_seconds(proto.windows)  # type: ignore[attr-defined]
    finally:
        engine.close()
    out["vllm_prefill_only_s"] = round(prefill, 3)
    out["vllm_prefill_only_tokens_per_s"] = round(scored / prefill, 1)
    return out


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp


def llama_perplexity(args_: list[str], want: tuple[str, ...]) -> tuple[dict[str, float], float]:
    """Run llama-perplexity (repeated when its log loses the summary: tests/test_gguf_llamacpp_eval.py says why);
    the figures asked for and the wall seconds of the run that gave them."""
    from quantkit.producers.gguf import tools

    patterns = {"ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
                "kld": r"Mean\s+KLD:\s*([\d.]+)", "top1": r"Same top p:\s*([\d.]+)"}
    for _ in range(3):
        t0, c0 = time.perf_counter(), children_cpu()
        out = tools.run("llama-perplexity", args_, purpose="the eval speed benchmark")
        secs, cpu = time.perf_counter() - t0, children_cpu() - c0
        text = out.stdout + out.stderr
        found = {k: re.search(patterns[k], text) for k in want}
        if all(found.values()):
            return {**{k: float(m.group(1)) for k, m in found.items() if m}, "cpu_s": round(cpu, 3)}, secs
    raise RuntimeError(f"llama-perplexity printed no summary in 3 runs:\n{text[-2000:]}")


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: on a shared machine the work a run did,
    whatever else competed for the cores."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def read_kld_base(path: Path) -> tuple[int, list[list[int]]]:
    """n_ctx and the token chunks of a --kl-divergence-base file (magic, n_ctx, n_vocab, n_chunk, tokens)."""
    import numpy as np

    data = path.read_bytes()
    n_ctx, _vocab, n_chunk = np.frombuffer(data, dtype="<i4", count=3, offset=8)
    tokens = np.frombuffer(data, dtype="<i4", count=int(n_ctx * n_chunk), offset=20)
    return int(n_ctx), [tokens[k * n_ctx:(k + 1) * n_ctx].tolist() for k in range(int(n_chunk))]


def adds_bos(gguf_file: Path) -> bool:
    """The file's tokenizer.ggml.add_bos_token (llama.cpp's default, true, when it has none)."""
    import gguf

    field = gguf.GGUFReader(gguf_file).fields.get("tokenizer.ggml.add_bos_token")
    return True if field is None else bool(field.parts[-1][0])


def ours(base: Path, art: Path, windows: list[Window], ctx: int, tmp: Path) -> dict[str, Any]:
    """quantkit's llama.cpp engine and comparison over ``windows``, the F32 file as baseline; artifact timed."""
    store = BaselineStore(tmp, sum(w.n_scored for w in windows))
    result: dict[str, Any] = {}
    for label, path in (("baseline", base), ("artifact", art)):
        engine = open_engine("llama.cpp", path, EngineOptions(ctx=ctx, device="cpu"))
        acc = Accumulator()
        t0, c0 = time.perf_counter(), time.process_time()
        rows: Rows
        for rows in scored_rows(engine, windows):
            if label == "baseline":
                store.put_rows(rows)
            acc.add_scores(score_rows(rows, None if label == "baseline" else store))
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        engine.close()
        result[label] = {"scoring_s": round(secs, 3), "cpu_s": round(cpu, 3),
                         "tokens_per_s": round(acc.tokens / secs, 1), **figures(acc.result())}
    return result


def llamacpp_part(model: Path, files: dict[str, Path], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from quantkit.calibration import eval_text
    from transformers import AutoTokenizer

    text_file = work / "heldout.txt"
    text_file.write_text(eval_text("heldout", "text")[0], encoding="utf-8")
    chunks = max(1, args.tokens // args.ctx)
    common = ["-c", str(args.ctx), "-b", str(args.ctx), "-t", str(os.cpu_count() or 1)]
    base_file = work / "base.kld"
    _, base_s = llama_perplexity(["-m", str(files["F32"]), "-f", str(text_file), "--chunks", str(chunks),
                                  "--kl-divergence-base", str(base_file), *common], want=())
    theirs, q_s = llama_perplexity(["-m", str(files["Q8_0"]), "--kl-divergence-base", str(base_file),
                                    "--kl-divergence", *common], want=("ppl", "ppl_base", "kld", "top1"))
    n_ctx, token_chunks = read_kld_base(base_file)
    # llama-perplexity puts BOS in place of a chunk's first token only where the file says to add one
    # (tokenizer.ggml.add_bos_token; SmolLM2's says no): then the chunk is scored as it is.
    bos = AutoTokenizer.from_pretrained(model).bos_token_id if adds_bos(files["F32"]) else None
    half = [Window(index=k, tokens=tuple(c) if bos is None else (bos, *c[1:]), score_from=n_ctx // 2 + 1)
            for k, c in enumerate(token_chunks)]
    scored = sum(w.n_scored for w in half)
    full = protocol.build(model, dataset="heldout", ctx=args.ctx, max_tokens=args.tokens).windows
    with tempfile.TemporaryDirectory() as tmp:
        same = ours(files["F32"], files["Q8_0"], half, n_ctx, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        own = ours(files["F32"], files["Q8_0"], full, args.ctx, Path(tmp))
    return {"chunks": len(token_chunks), "ctx": n_ctx, "tokens_scored": scored, "bos_prefixed": bos is not None,
            "llama_perplexity": {"base_s": round(base_s, 3), "kld_s": round(q_s, 3),
                                 "tokens_per_s": round(scored / q_s, 1), **theirs},
            "quantkit_same_tokens": same, "quantkit_own_protocol": own}


# ---------------------------------------------------------------------------------------------------------------
# report


def markdown(h: dict[str, Any], data: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"# Evaluation speed: scored tokens per second ({args.device})", "", meta.md_header(h),
             f"- load average at start: {data['loadavg_start']}; at end: {data['loadavg_end']}",
             f"- protocol: held-out text, ctx {args.ctx}, {args.tokens:,} tokens, model {data['model']}", ""]
    if t := data.get("transformers"):
        lines += ["## transformers", "", f"batch {t['batch']} windows per pass; KLD {t['kld_method']}", "",
                  "| path | pass | seconds | scored tok/s | ppl | KLD | top-1 |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for path, part in (("quantkit eval (batched, on the device)", t), ("previous (per window, numpy)",
                                                                            t.get("previous"))):
            for name in ("baseline", "artifact") if part else ():
                r = part[name]
                lines.append(f"| {path} | {name} | {r['scoring_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['ppl']:.4f} | "
                             f"{_f(r['kld'])} | {_f(r['top1'])} |")
        lines.append("")
    if v := data.get("vllm"):
        lines += ["## vLLM", "", "| what | seconds | scored tok/s |", "| --- | --- | --- |",
                  f"| quantkit's scoring (eval --engine vllm) | {v['quantkit_scoring_s']:.2f} | "
                  f"{v['quantkit_tokens_per_s']:,.0f} |",
                  f"| vLLM's own llm.generate with prompt_logprobs | {_f(v.get('vllm_generate_s'), '.2f')} | "
                  f"{_f(v.get('vllm_prompt_logprobs_tokens_per_s'), ',.0f')} |",
                  f"| the same windows without prompt_logprobs | {v['vllm_prefill_only_s']:.2f} | "
                  f"{v['vllm_prefill_only_tokens_per_s']:,.0f} |", "",
                  f"quantkit / vLLM's own: {v.get('ratio')}x; ppl {v['ppl']:.4f}, KLD {_f(v['kld'])} "
                  f"({v['kld_method']}), top-1 {_f(v['top1'])}", ""]
    if c := data.get("llama.cpp"):
        lp, same, own = c["llama_perplexity"], c["quantkit_same_tokens"], c["quantkit_own_protocol"]
        lines += ["## llama.cpp (Q8_0 against F32)", "",
                  f"{c['chunks']} chunks of {c['ctx']}, {c['tokens_scored']:,} tokens scored (second halves)", "",
                  "| what | seconds | CPU seconds | scored tok/s | ppl (base) | ppl | KLD | top-1 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |",
                  f"| llama-perplexity --kl-divergence (whole run, load included) | {lp['kld_s']:.2f} | "
                  f"{lp['cpu_s']:.2f} | {lp['tokens_per_s']:,.0f} | {lp['ppl_base']:.6f} | {lp['ppl']:.6f} | "
                  f"{lp['kld']:.6f} | {lp['top1'] / 100:.4f} |",
                  *[f"| quantkit, {what} | {r['artifact']['scoring_s']:.2f} | {r['artifact']['cpu_s']:.2f} | "
                    f"{r['artifact']['tokens_per_s']:,.0f} | {r['baseline']['ppl']:.6f} | {r['artifact']['ppl']:.6f} | "
                    f"{r['artifact']['kld']:.6f} | {r['artifact']['top1']:.4f} |"
                    for what, r in (("the same tokens", same), ("its own protocol (every token, BOS first)", own))],
                  "", "llama-perplexity's Mean KLD uses its base file's log-probabilities, stored in 16 bits per "
                  "entry; quantkit's store keeps float16. Scoring seconds exclude loading for quantkit; "
                  "llama-perplexity's include its load.", ""]
    return "\n".join(lines) + "\n"


def _f(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--engines", default="transformers,llama.cpp")
    ap.add_argument("--no-previous", dest="previous", action="store_false")
    ap.add_argument("--vllm-python")
    ap.add_argument("--vllm-path", action="append", default=[])
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-eval-speed")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eval_speed_cpu")
    args = ap.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    h = meta.header()
    data: dict[str, Any] = {**h, "model": str(args.model), "ctx": args.ctx, "tokens": args.tokens,
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    arts = artifacts(args.model, args.workdir, "llama.cpp" in engines)
    if "transformers" in engines:
        data["transformers"] = transformers_part(args.model, arts["rtn"], args)
    if "vllm" in engines:
        data["vllm"] = vllm_part(args.model, arts["rtn"], args, vllm_python(args, args.workdir))
    if "llama.cpp" in engines:
        data["llama.cpp"] = llamacpp_part(args.model, arts, args, args.workdir)
    data["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    j, m = meta.write("eval_speed", data, markdown(h, data, args), args.out)
    print(m.read_text())
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
