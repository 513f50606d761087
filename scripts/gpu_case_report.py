"""The checks of a GPU case against what was measured, and the results table. Pure: an outcome dict in (what the
runner recorded, or an earlier run's results.json), checks and markdown out."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpu_case_file import Case
from quantkit.engines.vllm import kernels


def matches(pattern: str, lines: list[str]) -> bool:
    """A substring of one of the lines, or /regex/ searched in each."""
    if len(pattern) > 1 and pattern.startswith("/") and pattern.endswith("/"):
        rx = re.compile(pattern[1:-1])
        return any(rx.search(line) for line in lines)
    return any(pattern in line for line in lines)


# vLLM 0.26.0's log: compressed_tensors_moe.get_moe_method names the WNA16 methods ("Using
# CompressedTensorsWNA16MarlinMoEMethod"); each fused-MoE oracle names its backend and family ("Using VLLM_CUTLASS Fp8
# MoE backend out of ...", "Using 'MARLIN' WNA16 MoE backend.", "Using TRITON Int8 MoE backend ...").
_MOE_METHOD = re.compile(r"\bUsing (\w+MoEMethod)\b")
_MOE_ORACLE = re.compile(r"\bUsing '?([A-Z][A-Z0-9_]*)'? (\w+) MoE backend\b")
# Where vLLM does not log the method: the one compressed-tensors MoE method that reaches each oracle
# (compressed_tensors_moe.py: only CompressedTensorsW8A8Fp8MoEMethod selects an Fp8 backend, only
# CompressedTensorsW8A8Int8MoEMethod an Int8 one; an ignored MoE layer gets UnquantizedFusedMoEMethod).
_CT_METHOD_OF_ORACLE = {"Fp8": "CompressedTensorsW8A8Fp8MoEMethod", "Int8": "CompressedTensorsW8A8Int8MoEMethod",
                        "Unquantized": "UnquantizedFusedMoEMethod"}


def moe_facts(log: str, quantization: str | None) -> dict[str, Any] | None:
    """The MoE method and backend a vLLM log records (None for a log without fused experts): ``method`` is the one
    vLLM logged, or, for a compressed-tensors checkpoint, the one its oracle's line implies (``method_from``)."""
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    methods = list(dict.fromkeys(_MOE_METHOD.findall(log)))
    oracles = list(dict.fromkeys(f"{backend} ({family})" for backend, family in _MOE_ORACLE.findall(log)))
    if not methods and not oracles:
        return None
    method, source = (methods[-1], "log") if methods else (None, None)
    if method is None and quantization == "compressed-tensors":
        family = _MOE_ORACLE.findall(log)[-1][1]
        method, source = _CT_METHOD_OF_ORACLE.get(family), "oracle line"
    return {"method": method, "method_from": source, "methods": methods, "backends": oracles}


def moe_lines(load: dict[str, Any]) -> list[str]:
    """The MoE method as a line for checks and the table ("CompressedTensorsW8A8Fp8MoEMethod (from oracle line)")."""
    moe = (load or {}).get("moe") or {}
    if not moe.get("method"):
        return []
    return [moe["method"] + (" (from oracle line)" if moe.get("method_from") == "oracle line" else "")]


def _check(name: str, expected: Any, actual: Any, ok: bool | None, note: str = "") -> dict[str, Any]:
    status = "skip" if ok is None else ("pass" if ok else "fail")
    return {"check": name, "expected": expected, "actual": actual, "status": status, "note": note}


def evaluate(c: Case, o: dict[str, Any]) -> list[dict[str, Any]]:
    """Every expectation of the case against what was measured. A measurement is a skip only when the step
    that makes it did not run (no load, no evaluation); missing from a step that ran, it is a fail."""
    e, checks = c.expect, []
    load = o.get("load")
    ran = load is not None and load.get("status") not in (None, "not run")
    loaded = ran and load["status"] == "ok"
    facts = (load or {}).get("facts") or {}
    checks.append(_check("loads", e.loads, loaded if ran else None, (loaded == e.loads) if ran else None,
                         "" if loaded or not ran else (load.get("error") or "")[:200]))
    if e.quantization:
        got = facts.get("quantization") or ((load or {}).get("extra") or {}).get("quantization")
        checks.append(_check("quantization", e.quantization, got, (got == e.quantization) if loaded else None))
    linear = [f"{k} for {layer}" for layer, k in facts.get("linear") or []]
    if e.kernel:
        checks.append(_check("kernel", e.kernel, linear, matches(e.kernel, linear) if loaded else None))
    if e.moe_kernel:
        moe = list(facts.get("moe") or [])
        checks.append(_check("moe_kernel", e.moe_kernel, moe, matches(e.moe_kernel, moe) if loaded else None))
    if e.moe_method:
        got = moe_lines(load or {})
        checks.append(_check("moe_method", e.moe_method, got, matches(e.moe_method, got) if loaded else None))
    for b, floor in e.min_tok_s.items():
        got = ((load or {}).get("decode_tok_s") or {}).get(str(b))
        # a model that loaded and has no figure for an expected batch failed to decode it: a fail, not a skip
        ok = (got >= floor) if got is not None else (False if loaded else None)
        checks.append(_check(f"tok/s b{b}", floor, got, ok, "" if got is not None or not loaded else
                             "the load succeeded but this batch was not measured"))
    smoke = o.get("smoke")
    if e.smoke is not None:
        got = (smoke or {}).get("status")
        ok = None if got in (None, "not run") else (got == "passed") == e.smoke
        checks.append(_check("smoke", "passed" if e.smoke else "fails", got, ok, (smoke or {}).get("error") or ""))
    if smoke and smoke.get("doctor_ok") is not None and ran:
        checks.append(_check("doctor agrees", loaded, smoke["doctor_ok"], smoke["doctor_ok"] == loaded,
                             "; ".join(smoke.get("doctor") or [])[:300]))
    ev = o.get("eval") or {}
    scored = bool(ev) and "error" not in ev
    for key, metric, upper in (("max_kld", "kld", True), ("max_ppl_ratio", "ppl_ratio", True),
                               ("min_top1", "top1", False)):
        limit = getattr(e, key)
        if limit is not None:
            got = ev.get(metric)
            ok = (got <= limit if upper else got >= limit) if got is not None else (False if scored else None)
            checks.append(_check(metric, limit, got, ok, "" if got is not None or not scored else
                                 "the evaluation ran but did not report this metric"))
    if e.max_engine_ppl_diff is not None:
        diff = engine_ppl_diff(o)
        checks.append(_check("engines agree", e.max_engine_ppl_diff, diff,
                             None if diff is None else abs(diff) <= e.max_engine_ppl_diff,
                             "ppl vLLM / ppl transformers - 1, same tokens"))
    return checks


def engine_ppl_diff(o: dict[str, Any]) -> float | None:
    """vLLM's perplexity of the artifact over transformers' on the same tokens, minus 1 (None unless both ran)."""
    v, t = (o.get("eval") or {}).get("ppl"), (o.get("eval_transformers") or {}).get("ppl")
    return None if v is None or t is None else v / t - 1


def verdict(o: dict[str, Any]) -> str:
    """pass, fail (a check failed) or error (a step could not produce what the checks need)."""
    if o.get("error"):
        return "error"
    if any(ch["status"] == "fail" for ch in o.get("checks") or []):
        return "fail"
    return "pass"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The run as a table: one row per case, then the failed checks and the kernel sweeps."""
    lines = ["# GPU end-to-end cases", "", f"- started {header.get('started')}, updated {header.get('updated')}",
             f"- machine: {', '.join(header.get('gpus') or ['no GPU seen'])}; vLLM {header.get('vllm') or '?'}", "",
             "| case | artifact | loads | vLLM quantization | kernel vLLM picked | tok/s b1 | tok/s b16 | smoke | "
             "KLD | ppl ratio | top-1 | checks | status |", "|" + "---|" * 13]
    for r in results:
        load, ev, smoke = r.get("load") or {}, r.get("eval") or {}, r.get("smoke") or {}
        facts = load.get("facts") or {}
        checks = r.get("checks") or []
        passed = sum(ch["status"] == "pass" for ch in checks)
        failed = [ch["check"] for ch in checks if ch["status"] == "fail"]
        tok = load.get("decode_tok_s") or {}
        cells = [r["name"], (r.get("artifact") or {}).get("status", "-"),
                 {"ok": "yes", None: "-", "not run": "-"}.get(load.get("status"), "NO"),
                 facts.get("quantization") or "-",
                 "<br>".join([*(facts.get("kernels") or []), *moe_lines(load)]) or "-",
                 _num(tok.get("1"), ".0f"), _num(tok.get("16"), ".0f"), smoke.get("status") or "-",
                 _num(ev.get("kld"), ".4f"), _num(ev.get("ppl_ratio"), ".4f"), _num(ev.get("top1"), ".3f"),
                 f"{passed}/{len(checks)}" + (f" (failed: {', '.join(failed)})" if failed else ""),
                 r.get("status", "-") + (f": {r['reason']}" if r.get("reason") else "")]
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    bad = [(r["name"], ch) for r in results for ch in r.get("checks") or [] if ch["status"] == "fail"]
    if bad:
        lines += ["", "## Failed checks", ""]
        lines += [f"- {n}: {ch['check']}: expected {ch['expected']!r}, got {ch['actual']!r}"
                  + (f" ({ch['note']})" if ch.get("note") else "") for n, ch in bad]
    both = [r for r in results if (r.get("eval") or {}).get("ppl") and (r.get("eval_transformers") or {}).get("ppl")]
    if both:
        lines += ["", "## vLLM vs transformers (quantkit eval, the same tokens)", "",
                  "| case | ppl vLLM | ppl transformers | difference | top-1 vLLM | top-1 transformers | "
                  "KLD vLLM (bound) | KLD transformers |", "|---|---|---|---|---|---|---|---|"]
        for r in both:
            v, t = r["eval"], r["eval_transformers"]
            lines.append(f"| {r['name']} | {v['ppl']:.3f} | {t['ppl']:.3f} | {engine_ppl_diff(r):+.2%} | "
                         f"{_num(v.get('top1'), '.4f')} | {_num(t.get('top1'), '.4f')} | {_num(v.get('kld'), '.5f')} | "
                         f"{_num(t.get('kld'), '.5f')} |")
    errors = [(r["name"], r["error"]) for r in results if r.get("error")]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {n}: {e}" for n, e in errors]
    for r in results:
        sw = r.get("sweep")
        if sw:
            ms = [kernels.Measurement.from_json(m) for m in sw.get("measurements") or []]
            choice = sw.get("choice")
            ch = kernels.Choice(kernels.Configuration.from_json(choice["configuration"]), choice["reason"],
                                choice["measured"]) if choice else None
            lines += ["", f"## Kernel sweep: {r['name']}", "",
                      kernels.markdown(ms, ch, tuple(sw["bench"]["batches"])).rstrip()]
            if sw.get("command"):
                lines += ["", f"Serve with: `{sw['command']['shell']}`"]
    return "\n".join(lines) + "\n"


def smoke_summary(data: Any, rc: int, log: Path) -> dict[str, Any]:
    """What the checks need from ``quantkit smoke --json``."""
    if not isinstance(data, dict):
        return {"status": "failed", "error": f"quantkit smoke exited {rc} without JSON: {tail(log)}"}
    run = (data.get("runs") or [{}])[0]
    doctor = data.get("doctor") or {}
    facts = run.get("facts") or {}
    return {"status": run.get("status"), "ttft_s": run.get("ttft_s"), "decode_tok_s": run.get("decode_tokens_per_s"),
            "healthy_after_s": run.get("healthy_after_s"), "kernels": facts.get("kernels"),
            "quantization": facts.get("quantization"), "doctor_ok": doctor.get("ok"),
            "doctor": [f"{ch['status']}: {ch['name']}: {ch['message']}" for ch in doctor.get("checks") or []
                       if ch.get("status") != "ok"],
            "completion": (run.get("completion") or {}).get("text"), "error": run.get("error"), "log": run.get("log"),
            **({"image": {k: run["image"].get(k) for k in ("image", "text", "image_tokens", "prompt_tokens")}}
               if isinstance(run.get("image"), dict) else {})}


def eval_summary(data: Any, rc: int, log: Path) -> dict[str, Any]:
    """What the checks need from ``quantkit eval --json`` (exit 3, a gate, still wrote the report)."""
    if not isinstance(data, dict) or not data.get("results"):
        return {"error": f"quantkit eval exited {rc} without results: {tail(log)}"}
    r = data["results"][0]
    return {"kld": r.get("kld"), "ppl_ratio": r.get("ppl_ratio"), "top1": r.get("top1"), "ppl": r.get("ppl"),
            "baseline_ppl": (data.get("baseline") or {}).get("ppl"), "tokens": r.get("tokens"),
            "engine": r.get("engine"), "exit": rc,
            **({"images": {k: r["images"].get(k) for k in ("scored", "kld", "top1", "answer_tokens", "reason")}}
               if isinstance(r.get("images"), dict) else {})}


def tail(log: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " / ".join(lines[-n:])[-400:]
