"""Scored tokens per second of each engine's evaluation, on the same tokens (issue 44 item 1).

    python bench/eval_speed.py --device cpu --tokens 4096 --engines transformers,llama.cpp \
        --out bench/results/eval_speed_cpu
    python bench/eval_speed.py --device cuda --tokens 32768 --engines transformers,vllm \
        --vllm-python VLLM_PY [--vllm-path DIR] --out bench/results/h200/eval_speed
    python bench/eval_speed.py --device cuda --tokens 32768 --engines sglang --sglang-python SGLANG_PY \
        --out bench/results/h100/eval_speed

The model (``--model``, SmolLM2-135M-Instruct by default) and an artifact of it, made once in ``--workdir``, are scored
on the held-out text: a ``quantkit rtn`` artifact, for SGLang a ``quantkit fp8 --scheme dynamic`` one (:data:`SCORED`
says why), for llama.cpp a ``quantkit gguf`` F32 + Q8_0 artifact:

* ``transformers``: ``quantkit eval``'s path (batched windows, baseline kept on the device, KLD on the device), the
  baseline's pass and the artifact's, against the previous path measured the same way: one window per forward
  pass, full log-probabilities copied to the host and compared in numpy (``--no-previous`` skips it);
* ``vllm``: quantkit's scoring (``quantkit eval --engine vllm``: the worker's ``llm.generate`` with
  ``prompt_logprobs``, its conversion, the comparison on the baseline's device) against vLLM's own prompt-logprob
  throughput (the seconds inside ``llm.generate``, which the worker reports) and against the same windows run
  without ``prompt_logprobs`` (the forward passes alone: what bounds prompt log-probabilities);
* ``sglang``: quantkit's scoring (``quantkit eval --engine sglang``: batches of windows, three requests in flight,
  the answers converted to arrays, the comparison on the baseline's device) against SGLang's own answers to the same
  ``/generate`` requests sent the same way (decoded, not converted: its prompt-logprob throughput) and against the
  same windows without log-probabilities;
* ``llama.cpp``: ``llama-perplexity --kl-divergence-base`` (the F32 file) then, ``--rounds`` times alternated with
  quantkit, ``--kl-divergence`` (Q8_0) against quantkit's llama.cpp engine on the very tokens llama-perplexity
  scores (:func:`quantkit.evaluation.llama_perplexity.windows`), the F32 file as baseline here too so only the two
  programs differ, and on quantkit's own protocol (every token of each window scored, BOS first): medians of the
  wall and CPU seconds, each run's load average beside them (the machine may be shared).

vLLM runs in its own Python: ``--vllm-python`` (or ``QUANTKIT_VLLM_PYTHON``); ``--vllm-path DIR`` (repeatable) puts
folders of a ``pip install --target DIR`` on that Python's PYTHONPATH through a small wrapper script, as
``scripts/gpu_cases.py`` does; SGLang the same way (``--sglang-python``, ``QUANTKIT_SGLANG_PYTHON``,
``--sglang-path``). Results: ``eval_speed.json`` and ``eval_speed.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import meta  # noqa: E402

from quantkit.devices import cores  # noqa: E402
from quantkit.engines.logits import EngineOptions, Window, open_engine  # noqa: E402
from quantkit.evaluation import llama_perplexity, protocol  # noqa: E402
from quantkit.evaluation.evaluate import EvalOptions, evaluate  # noqa: E402
from quantkit.evaluation.metrics import Accumulator, BaselineStore, score_windows  # noqa: E402
from quantkit.progress import Reporter, use  # noqa: E402

MODEL = ROOT / "models" / "real" / "SmolLM2-135M-Instruct"
# The artifact each served engine scores against the model: quantkit's RTN (W4A16) where the engine runs it. SGLang
# 0.5.17 runs W4A16 layers only in its Marlin kernel, whose tiles do not divide SmolLM2's 576-wide layers (quantkit
# refuses it before a server starts: quantkit/engines/sglang/logits.py), so SGLang scores an FP8 (dynamic) artifact.
SCORED = {"transformers": "rtn", "vllm": "rtn", "sglang": "fp8"}
MADE_BY = {"rtn": ("rtn",), "fp8": ("fp8", "--scheme", "dynamic")}  # quantkit VERB MODEL OUT FLAGS...
OPENMP_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")  # recorded: both change how llama.cpp's and torch's threads wait


def quantkit(*args: Any) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "quantkit", *map(str, args), "--quiet"], cwd=ROOT, env=env, check=True)


def artifacts(model: Path, work: Path, engines: list[str]) -> dict[str, Path]:
    """The artifacts ``engines`` score (:data:`SCORED`; the GGUF files for llama.cpp), made once per workdir."""
    out: dict[str, Path] = {}
    for name in sorted({SCORED[e] for e in engines if e in SCORED}):
        out[name] = work / name
        if not (out[name] / "quantkit.json").is_file():
            verb, *flags = MADE_BY[name]
            quantkit(verb, model, out[name], *flags)
    if "llama.cpp" in engines:
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


def engine_python(engine: str, python: str | None, paths: list[str], work: Path) -> str | None:
    """An engine's interpreter (``--vllm-python``, else ``QUANTKIT_VLLM_PYTHON``; the same for SGLang); with
    ``--vllm-path`` (``--sglang-path``) a wrapper script that puts those folders (only) on its PYTHONPATH."""
    python = python or os.environ.get(f"QUANTKIT_{engine.upper()}_PYTHON")
    if not paths:
        return python
    wrapper = work / f"{engine}-python.sh"
    wrapper.write_text(f"#!/bin/sh\nexport PYTHONPATH={shlex.quote(os.pathsep.join(paths))}\n"
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


def sglang_part(model: Path, art: Path, args: argparse.Namespace, python: str | None) -> dict[str, Any]:
    """quantkit's scoring through SGLang (``eval --engine sglang``) against SGLang's own answers to the same requests
    (timed, decoded, not converted) and against the same windows without log-probabilities (what bounds them)."""
    report = evaluate([art], str(model), EvalOptions(dataset="heldout", ctx=args.ctx, max_tokens=args.tokens,
                                                     engine="sglang", device="cuda", python=python, write=False))
    res, proto = report.results[0], report.protocol
    scored = proto.tokens_scored
    out = {"tokens_scored": scored, "tokens_run": proto.tokens_evaluated, "kld_method": res.kld_method,
           "quantkit_scoring_s": res.engine["scoring_s"], "quantkit_tokens_per_s": res.engine["scored_tokens_per_s"],
           **figures(res.metrics)}
    engine = open_engine("sglang", art, EngineOptions(ctx=args.ctx, device="cuda", python=python))
    try:
        own = engine.request_seconds(proto.windows)  # type: ignore[attr-defined]
        prefill = engine.request_seconds(proto.windows, logprobs=False)  # type: ignore[attr-defined]
    finally:
        engine.close()
    out |= {"sglang_requests_s": round(own, 3), "sglang_prompt_logprobs_tokens_per_s": round(scored / own, 1),
            "ratio": round(out["quantkit_scoring_s"] / own, 3), "sglang_prefill_only_s": round(prefill, 3),
            "sglang_prefill_only_tokens_per_s": round(scored / prefill, 1)}
    return out


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp


def baseline_store(base: Path, windows: list[Window], ctx: int, tmp: Path) -> tuple[BaselineStore, float]:
    """The F32 file's distributions over ``windows``, kept as ``quantkit eval`` keeps the baseline's (untimed), and
    its perplexity there."""
    store = BaselineStore(tmp, sum(w.n_scored for w in windows))
    engine = open_engine("llama.cpp", base, EngineOptions(ctx=ctx, device="cpu"))
    try:
        return store, score_windows(engine, windows, store, baseline=True).ppl
    finally:
        engine.close()


def ours(art: Path, windows: list[Window], ctx: int, store: BaselineStore) -> dict[str, Any]:
    """quantkit's llama.cpp engine and comparison over ``windows``: seconds and CPU seconds of the load and the
    scoring (this process's CPU time: llama.cpp's threads and torch's)."""
    t0, c0 = time.perf_counter(), time.process_time()
    engine = open_engine("llama.cpp", art, EngineOptions(ctx=ctx, device="cpu"))
    t1, c1 = time.perf_counter(), time.process_time()
    try:
        m = score_windows(engine, windows, store, baseline=False)
    finally:
        engine.close()
    t2, c2 = time.perf_counter(), time.process_time()
    return {"whole_s": t2 - t0, "whole_cpu_s": c2 - c0, "scoring_s": t2 - t1, "scoring_cpu_s": c2 - c1,
            **figures(m)}


def theirs(art: Path, base_file: Path, common: list[str]) -> dict[str, Any]:
    """``llama-perplexity --kl-divergence`` on ``art`` against the stored F32 run: the whole process (its load and
    its read of the base file included)."""
    r = llama_perplexity.run(["-m", str(art), "--kl-divergence-base", str(base_file), "--kl-divergence", *common],
                             want=("ppl", "ppl_base", "kld", "top1"), purpose="the eval speed benchmark")
    return {"whole_s": r.wall_s, "whole_cpu_s": r.cpu_s, **r.figures, "top1": r.figures["top1"] / 100}


def llamacpp_part(model: Path, files: dict[str, Path], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """llama-perplexity and quantkit's engine alternated, ``--rounds`` times each, on the same tokens; quantkit on
    its own protocol too. Each run records the 1-minute load average it started under."""
    from quantkit.calibration import eval_text

    text_file = work / "heldout.txt"
    text_file.write_text(eval_text("heldout", "text")[0], encoding="utf-8")
    common = ["-c", str(args.ctx), "-b", str(args.ctx), "-t", str(cores())]
    base_file = work / "base.kld"
    chunks = str(max(1, args.tokens // args.ctx))
    llama_perplexity.run(["-m", str(files["F32"]), "-f", str(text_file), "--chunks", chunks, "--kl-divergence-base",
                          str(base_file), *common], want=(), purpose="the eval speed benchmark")
    half = llama_perplexity.windows(base_file, files["F32"])
    full = protocol.build(model, dataset="heldout", ctx=args.ctx, max_tokens=args.tokens).windows
    runs: dict[str, list[dict[str, Any]]] = {"llama_perplexity": [], "quantkit_same_tokens": [],
                                             "quantkit_own_protocol": []}
    with tempfile.TemporaryDirectory() as t1, tempfile.TemporaryDirectory() as t2:
        stores = {"quantkit_same_tokens": (half, *baseline_store(files["F32"], half, args.ctx, Path(t1))),
                  "quantkit_own_protocol": (full, *baseline_store(files["F32"], full, args.ctx, Path(t2)))}
        for r in range(args.rounds):
            for name in list(runs)[::1 if r % 2 == 0 else -1]:  # alternated: neither always runs first
                load = round(os.getloadavg()[0], 2)
                if name == "llama_perplexity":
                    res = theirs(files["Q8_0"], base_file, common)
                else:
                    windows, store, ppl_base = stores[name]
                    res = {**ours(files["Q8_0"], windows, args.ctx, store), "ppl_base": ppl_base}
                runs[name].append({"loadavg_1min": load, **{k: round(v, 6) if isinstance(v, float) else v
                                                            for k, v in res.items()}})
    scored = {"llama_perplexity": sum(w.n_scored for w in half), "quantkit_same_tokens": sum(w.n_scored for w in half),
              "quantkit_own_protocol": sum(w.n_scored for w in full)}
    return {"chunks": len(half), "ctx": len(half[0].tokens), "tokens_scored": scored["llama_perplexity"],
            "bos_prefixed": llama_perplexity.bos_to_add(files["F32"]) is not None, "threads": cores(),
            "rounds": args.rounds, "runs": runs, "medians": {k: medians(v, scored[k]) for k, v in runs.items()}}


def medians(runs: list[dict[str, Any]], scored: int) -> dict[str, Any]:
    """The median of each timing over the runs, scored tokens per second of the median seconds, and the figures
    (the same in every run)."""
    keys = [k for k in ("whole_s", "whole_cpu_s", "scoring_s", "scoring_cpu_s") if k in runs[0]]
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    out |= {f"tokens_per_s_{k[:-2]}": round(scored / out[k], 1) for k in ("whole_s", "scoring_s") if k in out}
    out |= {k: runs[0][k] for k in ("tokens", "ppl_base", "ppl", "kld", "top1") if k in runs[0]}
    out["tokens_scored"] = scored
    return out


# ---------------------------------------------------------------------------------------------------------------
# report


def markdown(h: dict[str, Any], data: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"# Evaluation speed: scored tokens per second ({args.device})", "", meta.md_header(h),
             f"- load average at start: {data['loadavg_start']}; at end: {data['loadavg_end']}",
             f"- environment: {', '.join(f'{k}={v}' for k, v in data['env'].items()) or 'no OpenMP settings'}",
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
        lines += engine_section("vLLM", v, [
            ("quantkit's scoring (eval --engine vllm)", v["quantkit_scoring_s"], v["quantkit_tokens_per_s"]),
            ("vLLM's own llm.generate with prompt_logprobs", v.get("vllm_generate_s"),
             v.get("vllm_prompt_logprobs_tokens_per_s")),
            ("the same windows without prompt_logprobs", v["vllm_prefill_only_s"],
             v["vllm_prefill_only_tokens_per_s"])])
    if s := data.get("sglang"):
        lines += engine_section("SGLang", s, [
            ("quantkit's scoring (eval --engine sglang)", s["quantkit_scoring_s"], s["quantkit_tokens_per_s"]),
            ("SGLang's own answers to the same /generate requests (decoded, not converted)", s["sglang_requests_s"],
             s["sglang_prompt_logprobs_tokens_per_s"]),
            ("the same windows without log-probabilities", s["sglang_prefill_only_s"],
             s["sglang_prefill_only_tokens_per_s"])])
    if c := data.get("llama.cpp"):
        lines += llamacpp_markdown(c)
    return "\n".join(lines) + "\n"


def engine_section(name: str, d: dict[str, Any], rows: list[tuple[str, float | None, float | None]]) -> list[str]:
    """A served engine's section: quantkit's scoring beside the engine's own figures (what, seconds, scored tok/s),
    then the ratio and the figures scored."""
    return [f"## {name}", "", "| what | seconds | scored tok/s |", "| --- | --- | --- |",
            *(f"| {what} | {_f(sec, '.2f')} | {_f(rate, ',.0f')} |" for what, sec, rate in rows), "",
            f"quantkit / {name}'s own: {d.get('ratio')}x; ppl {d['ppl']:.4f}, KLD {_f(d['kld'])} ({d['kld_method']}), "
            f"top-1 {_f(d['top1'])}", ""]


def llamacpp_markdown(c: dict[str, Any]) -> list[str]:
    """The llama.cpp section: medians of the alternated runs, then every run with the load it started under."""
    med = c["medians"]
    lp, same, own = med["llama_perplexity"], med["quantkit_same_tokens"], med["quantkit_own_protocol"]
    rows = [("llama-perplexity --kl-divergence, whole run (load and base file read included)", lp, "whole"),
            ("quantkit, the same tokens: load + scoring", same, "whole"),
            ("quantkit, the same tokens: scoring", same, "scoring"),
            ("quantkit, its own protocol (every token, BOS first): scoring", own, "scoring")]
    lines = ["## llama.cpp (Q8_0 against F32)", "",
             f"{c['chunks']} chunks of {c['ctx']}, {c['tokens_scored']:,} tokens scored (second halves), "
             f"{c['threads']} threads on both sides; medians of {c['rounds']} runs each, alternated", "",
             "| what | seconds | CPU seconds | scored tok/s | ppl (base) | ppl | KLD | top-1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for what, r, part in rows:
        lines.append(f"| {what} | {r[f'{part}_s']:.2f} | {r[f'{part}_cpu_s']:.2f} | {r[f'tokens_per_s_{part}']:,.0f} | "
                     f"{r['ppl_base']:.6f} | {r['ppl']:.6f} | {r['kld']:.6f} | {r['top1']:.4f} |")
    lines += ["", "| run | load avg (1 min) at start | llama-perplexity s / CPU s | quantkit same tokens s / CPU s "
                  "(load + scoring) | quantkit own protocol s / CPU s (load + scoring) |",
              "| --- | --- | --- | --- | --- |"]
    runs = c["runs"]
    for i in range(c["rounds"]):
        a, b, d = (runs[k][i] for k in ("llama_perplexity", "quantkit_same_tokens", "quantkit_own_protocol"))
        lines.append(f"| {i + 1} | {a['loadavg_1min']} / {b['loadavg_1min']} / {d['loadavg_1min']} | "
                     f"{a['whole_s']:.2f} / {a['whole_cpu_s']:.2f} | {b['whole_s']:.2f} / {b['whole_cpu_s']:.2f} | "
                     f"{d['whole_s']:.2f} / {d['whole_cpu_s']:.2f} |")
    return lines + ["", "llama-perplexity's Mean KLD uses its base file's log-probabilities, stored in 16 bits per "
                    "entry; quantkit's store keeps float16. quantkit's CPU seconds are its process's (llama.cpp's "
                    "threads and torch's), llama-perplexity's its child process's.", ""]


def _f(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="llama.cpp: alternated runs of each side (medians)")
    ap.add_argument("--engines", default="transformers,llama.cpp")
    ap.add_argument("--no-previous", dest="previous", action="store_false")
    ap.add_argument("--vllm-python")
    ap.add_argument("--vllm-path", action="append", default=[])
    ap.add_argument("--sglang-python")
    ap.add_argument("--sglang-path", action="append", default=[])
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-eval-speed")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eval_speed_cpu")
    args = ap.parse_args()
    use(Reporter())  # an engine's server start shows its wait on stderr, as under the CLI (the API waits quietly)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    arts: dict[str, Path] = {}  # made below, once --engines is known to name parts that exist
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "transformers": lambda: transformers_part(args.model, arts[SCORED["transformers"]], args),
        "vllm": lambda: vllm_part(args.model, arts[SCORED["vllm"]], args,
                                  engine_python("vllm", args.vllm_python, args.vllm_path, args.workdir)),
        "sglang": lambda: sglang_part(args.model, arts[SCORED["sglang"]], args,
                                      engine_python("sglang", args.sglang_python, args.sglang_path, args.workdir)),
        "llama.cpp": lambda: llamacpp_part(args.model, arts, args, args.workdir)}
    if unknown := [e for e in engines if e not in parts]:
        ap.error(f"unknown engine {', '.join(unknown)}: --engines takes {', '.join(parts)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    h = meta.header()
    data: dict[str, Any] = {**h, "model": str(args.model), "ctx": args.ctx, "tokens": args.tokens,
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                            "env": {k: os.environ[k] for k in OPENMP_ENV if k in os.environ}}
    arts.update(artifacts(args.model, args.workdir, engines))
    # Each engine's figures are written as soon as they are measured: an engine that fails (a server that does not
    # start, a GPU session that ends) costs its own part, not the parts measured before it.
    for engine in engines:
        try:
            data[engine] = parts[engine]()
        finally:
            data["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
            j, m = meta.write("eval_speed", data, markdown(h, data, args), args.out)
    print(m.read_text())
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
