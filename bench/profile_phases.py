"""Where each process of a profiled benchmark spent its time: a py-spy profile read step by step.

``bench/quantize_cost.py`` compares quantkit with llm-compressor called directly by wall time and by each tool's own
step timers; where the steps disagree (quantkit's model load took 2.5 s on an H100 against the direct script's
0.4 s), only a profile of both processes says whether quantkit does more work or the same work in another step. Run
the benchmark under py-spy, sampling every child process and thread, idle ones included::

    py-spy record --subprocesses --nonblocking --idle --threads --rate 50 --format raw -o fp8.txt -- \\
        python bench/quantize_cost.py --shape 8b --methods fp8-static --tools llm-compressor,quantkit --repeat 1
    python bench/profile_phases.py fp8.txt --rate 50 --name fp8_profile --results-dir bench/results/h100/8b

For each profiled process of quantkit or of the direct script, the main thread's seconds by the innermost quantkit or
benchmark function on the stack (a step: ``CompressedProducer.produce:228 > run:237``), the seconds it spent
importing modules and which line of ours asked for them, and the seconds of the other threads that did work
(hashing, fsync; waiting threads are left out). ``--format raw`` gives stack counts, not a timeline: seconds are
samples over the rate.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

OURS = re.compile(r"\((quantkit/[^:]*|[^:]*bench/[^:]*|[^:]*quantize_cost\.py):(\d+)\)")
WAITING = ("Condition.wait", "Event.wait", "_worker (concurrent/futures/thread.py", "select (", "sleep (")


def read(path: Path) -> list[tuple[list[str], int]]:
    """(frames outermost first, samples) per line of a py-spy raw profile (plain or gzip)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [(stack.split(";"), int(n)) for stack, n in (line.rstrip("\n").rsplit(" ", 1) for line in f)]


def _own(frames: list[str], depth: int = 3) -> str:
    """The innermost ``depth`` frames of ours, as ``function:line`` joined by ``>``."""
    ours = [f"{f.split(' (')[0]}:{m.group(2)}" for f in frames if (m := OURS.search(f))]
    return " > ".join(ours[-depth:]) or "(outside quantkit and bench code)"


def summarize(rows: list[tuple[list[str], int]], rate: float) -> dict[str, Any]:
    """Per process whose command is quantkit's or the direct script's: its steps, imports and working threads."""
    procs: dict[str, dict[str, Any]] = {}
    for frames, n in rows:
        proc = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread (")), "")
        code = [f for f in frames if not f.startswith(("process ", "thread ("))]
        if not proc or not re.search(r"-m quantkit |--direct ", proc[-1]):
            continue
        cmd = proc[-1].split(":", 1)[1].strip('"')
        tool = "quantkit" if "-m quantkit " in cmd else "llm-compressor directly"
        p = procs.setdefault(tool, {"command": cmd, "main": collections.Counter(), "imports": collections.Counter(),
                                    "threads": collections.Counter()})
        if thread.endswith("MainThread"):
            p["main"][_own(code)] += n
            if any("_find_and_load" in f for f in code):
                p["imports"][_own(code, 1)] += n
        elif code and not any(w in code[-1] for w in WAITING):
            name = re.sub(r"_\d+$", "", thread.split(": ", 1)[-1])  # pool workers counted together
            p["threads"][f"{name}: {code[-1].split(' (')[0]}"] += n
    return {tool: {"command": p["command"],
                   "main_s": round(sum(p["main"].values()) / rate, 2),
                   "imports_s": round(sum(p["imports"].values()) / rate, 2),
                   "steps": {k: round(v / rate, 2) for k, v in p["main"].most_common() if v / rate >= 0.1},
                   "imports": {k: round(v / rate, 2) for k, v in p["imports"].most_common() if v / rate >= 0.1},
                   "threads": {k: round(v / rate, 2) for k, v in p["threads"].most_common() if v / rate >= 0.1}}
            for tool, p in sorted(procs.items())}


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# Where the time went: {data['title']}", "", f"- command: `{data['command']}`",
             f"- profile: `{data['profile']}` (py-spy raw, {data['rate']:g} samples/s)", "", data["note"], ""]
    for tool, p in data["processes"].items():
        lines += [f"## {tool}", "", f"`{p['command']}`", "",
                  f"Main thread: {p['main_s']} s sampled, of which importing modules {p['imports_s']} s.", "",
                  "| main thread, innermost code of ours | s |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in p["steps"].items()]
        lines += ["", "| imports, asked for by | s |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in p["imports"].items()]
        if p["threads"]:
            lines += ["", "| other threads at work (thread: function) | thread-seconds |", "|---|---|"]
            lines += [f"| `{k}` | {v} |" for k, v in p["threads"].items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path, help="py-spy --format raw output (.txt or .txt.gz)")
    ap.add_argument("--rate", type=float, default=50.0, help="py-spy's --rate the profile was taken at")
    ap.add_argument("--title", default="quantkit and llm-compressor directly, one run each")
    ap.add_argument("--note", default="", help="a sentence for the page (the machine, the run)")
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS)
    ap.add_argument("--name", default="profile_phases")
    args = ap.parse_args()
    data = {"command": shlex.join(["python", "bench/profile_phases.py", *sys.argv[1:]]), "title": args.title,
            "profile": args.profile.name, "rate": args.rate, "note": args.note,
            "processes": summarize(read(args.profile), args.rate)}
    if not data["processes"]:
        ap.error(f"{args.profile}: no process of quantkit or of bench/quantize_cost.py --direct in the profile")
    meta.write(args.name, data, markdown(data), args.results_dir)
    print(markdown(data))


if __name__ == "__main__":
    main()
