"""SGLang beside vLLM on the same artifacts and tokens (issue 28): the table of bench/results/h200/sglang/run*/ from
the JSON documents quantkit's own commands print, one file per step, all in one folder RUN:

    quantkit VERB models/quantkit-tiny ARTS/A --force --json              > RUN/make-A.json
    quantkit eval ARTS/A --engine sglang --python SGLANG_PY $EVAL --json    > RUN/eval-A-sglang.json
    quantkit eval ARTS/A ARTS/B ... --engine vllm --python VLLM_PY $EVAL --json > RUN/eval-vllm-N.json
    quantkit smoke ARTS/A --engine sglang --python SGLANG_PY --json        > RUN/smoke-A-sglang.json   (or)
    quantkit doctor ARTS/A --engine sglang --python SGLANG_PY --json       > RUN/doctor-A-sglang.json
    python bench/engine_speed.py SRC_8B --engine sglang|vllm --python PY  > RUN/speed-8b-ENGINE.json
    python bench/sglang_vs_vllm.py RUN                                     # RUN/sglang_vs_vllm.{json,md}

with EVAL = ``--baseline models/quantkit-tiny --dataset heldout --max-tokens 32768 --ctx 2048``. An artifact A is a
folder name; the legacy layouts and ModelOpt's export are scored in their subfolder (``A/autoawq``, ``A/gptq``,
``A/hf``), and a vLLM eval of several artifacts (``eval-vllm-N``) is matched to each by the folder A in its path.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ENGINES = ("sglang", "vllm")
METRICS = ("ppl", "kld", "top1", "ppl_ratio")


def _load(run: Path, name: str) -> Any:
    try:
        return json.loads((run / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def rows(run: Path) -> list[dict[str, Any]]:
    """One row per artifact made in ``run``: each engine's figures, SGLang's smoke, doctor's non-ok checks, and the
    absolute differences where both engines scored it."""
    out = []
    vllm_batches = [r for f in sorted(run.glob("eval-vllm-*.json"))
                    for r in (_load(run, f.stem) or {}).get("results", [])]
    for make in sorted(run.glob("make-*.json")):
        a = make.stem[len("make-"):]
        row: dict[str, Any] = {"artifact": a}
        batch = [r for r in vllm_batches if a in Path(r.get("path", "")).parts]
        for eng in ENGINES:
            ev = _load(run, f"eval-{a}-{eng}")
            r = (ev or {}).get("results", [{}])[0] if ev else (batch[0] if eng == "vllm" and batch else {})
            row[eng] = {k: r.get(k) for k in METRICS} if r else None
            if eng == "sglang" and r:
                row["sglang_engine"] = r.get("engine")
        sm = _load(run, f"smoke-{a}-sglang")
        first = ((sm or {}).get("runs") or [{}])[0]
        row["smoke"] = {k: first.get(k) for k in ("status", "error", "decode_tokens_per_s", "healthy_after_s", "facts")}
        checks = (_load(run, f"doctor-{a}-sglang") or {}).get("checks") or \
            ((sm or {}).get("doctor") or {}).get("checks") or []
        row["doctor"] = [c for c in checks if c.get("status") != "ok"]
        if row["sglang"] and row["vllm"]:
            s, v = row["sglang"], row["vllm"]
            row["diff"] = {k: (abs(s[k] - v[k]) if s.get(k) is not None and v.get(k) is not None else None)
                           for k in ("ppl_ratio", "kld", "top1")}
        out.append(row)
    return out


def _f(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(run: Path, table: list[dict[str, Any]]) -> str:
    """The per-artifact table, and the 8B shape's decode speed in both engines where it was measured."""
    lines = ["| artifact | SGLang ppl ratio / KLD / top-1 | vLLM ppl ratio / KLD / top-1 | SGLang smoke | notes |",
             "| --- | --- | --- | --- | --- |"]
    for r in table:
        s, v, sm = r["sglang"] or {}, r["vllm"] or {}, r["smoke"]
        note = "; ".join(c["message"][:160] for c in r["doctor"] if c.get("status") == "fail") or \
            (sm.get("error") or "")[:160]
        lines.append(f"| {r['artifact']} | {_f(s.get('ppl_ratio'))} / {_f(s.get('kld'))} / {_f(s.get('top1'), 3)} | "
                     f"{_f(v.get('ppl_ratio'))} / {_f(v.get('kld'))} / {_f(v.get('top1'), 3)} | "
                     f"{sm.get('status') or '-'} | {note.replace('|', '/')} |")
    speed = {eng: _load(run, f"speed-8b-{eng}") for eng in ENGINES}
    if any(speed.values()):
        lines += ["", "| 8B shape, bf16 (CUDA graphs) | TTFT s | batch 1 tok/s | batch 16 tok/s | healthy after s |",
                  "| --- | --- | --- | --- | --- |"]
        for eng, sp in speed.items():
            b = (sp or {}).get("batches") or {}
            lines.append(f"| {eng} | {_f((sp or {}).get('ttft_s'), 3)} | "
                         f"{_f((b.get('1') or {}).get('decode_tokens_per_s'), 1)} | "
                         f"{_f((b.get('16') or {}).get('decode_tokens_per_s'), 1)} | "
                         f"{_f((sp or {}).get('healthy_after_s'), 0)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the folder of the step files")
    ap.add_argument("--out", type=Path, help="where sglang_vs_vllm.{json,md} go [default: RUN]")
    args = ap.parse_args(argv)
    out = args.out or args.run
    out.mkdir(parents=True, exist_ok=True)
    table = rows(args.run)
    (out / "sglang_vs_vllm.json").write_text(json.dumps(table, indent=1))
    text = markdown(args.run, table)
    (out / "sglang_vs_vllm.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
