"""The evaluation's outputs: ``report.md``, a size-vs-perplexity plot, and each artifact's manifest section.

Tested with matplotlib 3.11.2 (Agg backend, no display needed).

The report puts every model evaluated together in one table (format, size, bits per weight, perplexity, ratio
to the baseline, KLD, top-1, gates) above the protocol that produced the numbers, so a table can always be
traced back to the exact tokens scored. Each artifact's ``quantkit.json`` gets an ``evaluation`` section with
the same figures; :func:`quantkit.integrity.update_manifest` then seals the report files quantkit wrote inside
the artifact (and refuses the update where any other file differs from the manifest).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from quantkit import __version__, integrity
from quantkit.progress import Reporter
from quantkit.evaluation.results import HEADER, EvalReport, Result, row
from quantkit.manifest import now_iso, read_manifest, write_text_atomic

REPORT = "report.md"
PLOT = "size-vs-ppl.png"


def engine_line(info: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("engine", "version", "model") and v)
    return f"{info.get('engine')} {info.get('version') or ''}".strip() + (f" ({extra})" if extra else "")


def markdown(report: EvalReport, plot_name: str | None) -> str:
    p = report.protocol
    rows = [row(report.baseline, is_baseline=True)] + [row(r) for r in report.results]
    lines = ["# quantkit evaluation", "",
             f"Baseline `{report.baseline.target.path}`, {len(report.results)} artifact(s), "
             f"{p.tokens_scored:,} tokens of `{p.source}`.", "",
             "| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    lines += ["", "ratio = artifact perplexity / baseline perplexity. KLD = mean KL(baseline || artifact) per token, "
              "in nats. top-1 = share of tokens where both models' most likely next token agrees. Bits per weight = "
              "weight-file bits / baseline parameters.", ""]
    if plot_name:
        lines += [f"![size vs perplexity]({plot_name})", ""]
    lines += ["## Gates", ""]
    for r in report.results:
        checks = "; ".join(g.describe() for g in r.gates) or "no gate set"
        lines.append(f"- `{r.target.label}`: {checks}")
    lines += ["", "## Protocol", "",
              f"- dataset: `{p.dataset}` -> `{p.source}` ({p.kind}), source sha256 `{p.source_sha256}`",
              f"- text sha256 `{p.text_sha256}`; {p.stream_tokens:,} tokens in the text",
              f"- tokenizer: the baseline's (`{p.tokenizer}`), sha256 `{p.tokenizer_sha256}`, BOS id {p.bos_token_id}",
              f"- windows: {len(p.windows)} x ctx {p.ctx}, "
              + (f"stride {p.stride} (only each window's new tokens are scored)" if p.stride
                 else "non-overlapping")
              + (", each starting with BOS" if p.bos_token_id is not None else ", no BOS (the tokenizer has none)")
              + (f"; first {p.max_tokens:,} tokens (--max-tokens)" if p.max_tokens else ""),
              f"- tokens scored: {p.tokens_scored:,} (run through the models, context included: "
              f"{p.tokens_evaluated:,}); windows sha256 `{p.windows_sha256}`",
              f"- KLD: {report.kld_method}",
              f"- baseline engine: {engine_line(report.baseline.engine)}"]
    for r in report.results:
        lines.append(f"- `{r.target.label}`: {engine_line(r.engine)}, {r.seconds:.1f} s"
                     + (f"; KLD {r.kld_method}" if r.kld_method else ""))
    lines += [f"- note: {n}" for n in p.notes]
    lines += [f"- quantkit {__version__}, {now_iso()}", ""]
    return "\n".join(lines)


def plot(report: EvalReport, path: Path) -> Path:
    """Size (MiB) against perplexity for the baseline and every artifact, labelled, with the ratio gate drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    base = report.baseline
    base_ppl = base.metrics.ppl
    ax.scatter([base.target.size_bytes / 2**20], [base_ppl], marker="*", s=220, color="black", zorder=3,
               label="baseline")
    ax.annotate(base.target.label, (base.target.size_bytes / 2**20, base_ppl), textcoords="offset points",
                xytext=(6, 6), fontsize=8)
    seen: set[bool] = set()
    for r in report.results:
        if not math.isfinite(r.metrics.ppl):
            continue
        x = r.target.size_bytes / 2**20
        ax.scatter([x], [r.metrics.ppl], s=60, zorder=3, color="tab:green" if r.passed else "tab:red",
                   label=None if r.passed in seen else ("passes its gates" if r.passed else "fails a gate"))
        seen.add(r.passed)
        ax.annotate(r.target.label, (x, r.metrics.ppl), textcoords="offset points", xytext=(6, -10), fontsize=8)
    ax.axhline(base_ppl, color="black", lw=0.8, ls="--")
    limits = {r.target.gates.max_ppl_ratio for r in report.results if r.target.gates and r.target.gates.max_ppl_ratio}
    if len(limits) == 1:
        ax.axhline(base_ppl * limits.pop(), color="tab:red", lw=0.8, ls=":", label="max ppl ratio gate")
    sizes = [base.target.size_bytes] + [r.target.size_bytes for r in report.results]
    ax.set_xlim(0, max(sizes) / 2**20 * 1.3)  # room for the labels right of the largest point
    ax.set_xlabel("size of the weight files (MiB)")
    ax.set_ylabel("perplexity")
    p = report.protocol
    ax.set_title(f"size vs perplexity: {p.source}, ctx {p.ctx}, {p.tokens_scored:,} tokens", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": f"quantkit {__version__}"})  # what outputs.wrote recognises
    plt.close(fig)
    return path


def write(report: EvalReport, out_dir: Path, reporter: Reporter) -> None:
    """Write ``report.md`` and the plot into ``out_dir``; a missing matplotlib skips the plot with a warning."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path: Path | None = out_dir / PLOT
    try:
        plot(report, plot_path)
    except ImportError:
        reporter.warn("matplotlib is not installed, so the report has no plot (pip install 'quantkit[eval]')")
        plot_path = None
    report_path = out_dir / REPORT
    write_text_atomic(report_path, markdown(report, plot_path.name if plot_path else None))
    report.report_path, report.plot_path = report_path, plot_path


def _summary(results: list[Result]) -> dict[str, Any]:
    """A few figures ``quantkit inspect`` shows; one line per file when a folder holds several GGUF files."""
    def one(r: Result) -> dict[str, Any]:
        m = r.metrics.to_json()
        return {"ppl": _round(m["ppl"], 4), "ppl_ratio": _round(r.ppl_ratio, 4), "kld": _round(m["kld"], 6),
                "top1": _round(m["top1"], 4), "gates": "pass" if r.passed else "fail"}

    if len(results) == 1:
        return one(results[0])
    return {r.target.path.name: ", ".join(f"{k} {v}" for k, v in one(r).items()) for r in results}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def update_manifests(report: EvalReport) -> None:
    """Record the results in each evaluated artifact's ``quantkit.json`` (and re-seal the folder)."""
    by_dir: dict[Path, list[Result]] = {}
    for r in report.results:
        if r.target.manifest_dir is not None:
            by_dir.setdefault(r.target.manifest_dir, []).append(r)
    for folder, results in by_dir.items():
        section = {
            "created": now_iso(), "quantkit_version": __version__,
            "protocol": report.protocol.manifest(), "kld_method": report.kld_method,
            "baseline": report.baseline.to_json(), "results": [r.to_json() for r in results],
            "gates": results[0].target.gates.model_dump() if results[0].target.gates else None,
            "passed": all(r.passed for r in results), "summary": _summary(results),
            "numerics": next((r.numerics for r in results if r.numerics), None),
            "report": os.path.relpath(report.report_path, folder) if report.report_path else None,
            "plot": os.path.relpath(report.plot_path, folder) if report.plot_path else None,
        }
        previous = read_manifest(folder).evaluation
        section["tasks"] = previous.tasks if previous else None  # task accuracy is its own run: kept
        integrity.update_manifest(folder, evaluation=section)
