"""What every benchmark result file records besides its figures: the machine, the library versions, the date and
the exact command, so that anyone can tell where a figure came from and re-run it.

Standard library only (plus quantkit.versions), so it also works in a bare GPU environment.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    """GPU names and memory as nvidia-smi reports them; empty on a machine without NVIDIA GPUs."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return [x.strip() for x in out.stdout.splitlines() if x.strip()] if out.returncode == 0 else []


def gpu_name(line: str) -> str:
    """A GPU's name alone, from a line of :func:`gpus` ("NVIDIA H100 80GB HBM3, 81559 MiB" -> "NVIDIA H100 80GB
    HBM3") or as torch names the device (no memory figure): the one reading of nvidia-smi's name that the GPU's
    model and its bandwidth both start from."""
    return line.rsplit(",", 1)[0].strip() if "," in line else line.strip()


def gpu_model(line: str) -> str:
    """A folder name for the GPU of a line of :func:`gpus`: its name's first word with a digit, in lower case
    ("NVIDIA H100 80GB HBM3, 81559 MiB" -> "h100"), so an H100's results are not filed as an H200's."""
    words = re.split(r"[\s-]+", gpu_name(line))
    return next((w.lower() for w in words if any(ch.isdigit() for ch in w)), "gpu")


# Each GPU's memory bandwidth in bytes/s, by its whole name (gpu_name), as NVIDIA's datasheets give it: the decode
# limit's figure (bench/serve_speed.py). Not by gpu_model: an H100 PCIe (HBM2e, 2.0 TB/s) and an H100 NVL (3.9 TB/s)
# are "h100" too, and a limit against another card's bandwidth is wrong, not approximate.
BANDWIDTH = {"NVIDIA H100 80GB HBM3": 3.35e12,  # H100 SXM5, 80 GB HBM3
             "NVIDIA H200": 4.8e12}  # H200 SXM, 141 GB HBM3e


def bandwidth(line: str) -> float | None:
    """The memory bandwidth of the GPU a line of :func:`gpus` (or torch's device name) names; None for one that
    :data:`BANDWIDTH` lacks, so that no limit is computed against another card's figure."""
    return BANDWIDTH.get(gpu_name(line))


def machine() -> dict[str, Any]:
    """CPU model, core count, memory and GPUs of the machine measuring."""
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_bytes": mem, "gpus": gpus(),
            "platform": platform.platform(), "python": platform.python_version()}


def versions() -> dict[str, str]:
    """quantkit's tracked library versions, as the artifacts' manifests record them."""
    sys.path.insert(0, str(ROOT))
    from quantkit import versions as v

    return v.installed()


def command() -> str:
    """The command line that is running, as one shell-quoted string (relative to the repository root)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def header() -> dict[str, Any]:
    """The provenance block every result file starts with."""
    return {"command": command(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions()}


def md_header(h: dict[str, Any]) -> str:
    """The provenance block as markdown lines."""
    m = h["machine"]
    gpu = f"; GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""
    mem = f", {m['memory_bytes'] / 2**30:.0f} GiB RAM" if m.get("memory_bytes") else ""
    vers = ", ".join(f"{k} {v}" for k, v in sorted(h["versions"].items()))
    return (f"- command: `{h['command']}`\n- date: {h['date']}\n- machine: {m['cpu']}, {m['cores']} cores{mem}{gpu}\n"
            f"- versions: {vers}\n")


def write(name: str, data: dict[str, Any], markdown: str, folder: Path = RESULTS) -> tuple[Path, Path]:
    """Write ``name.json`` and ``name.md`` (the table) into ``folder``, atomically enough for incremental updates."""
    folder.mkdir(parents=True, exist_ok=True)
    j, m = folder / f"{name}.json", folder / f"{name}.md"
    for path, text in ((j, json.dumps(data, indent=2, default=str) + "\n"), (m, markdown)):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return j, m


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers on a command line (``1,4,16``)."""
    return [int(x) for x in text.split(",")]


def serving_parser(doc: str, *, checkpoints: str, engine: str, engine_path: str, timeout: float, timeout_help: str,
                   name: str, name_help: str) -> argparse.ArgumentParser:
    """The command line the serving benchmarks share (bench/serve_bench.py, bench/serve_speed.py): the checkpoints,
    the engine's Python (``--python``) and a PYTHONPATH for it (``engine_path``, the flag's name), prompt and output
    lengths, the timeout, and where the results go. Each script adds its own flags after these."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", type=Path, help=checkpoints)
    ap.add_argument("--python", help=f"{engine} Python [default: quantkit's rule, quantkit/envs.py: its variable, "
                                     "its script on PATH, this one]")
    ap.add_argument(engine_path, help=f"PYTHONPATH of {engine} Python (a folder pip install --target put it into)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt length in token ids")
    ap.add_argument("--gen", type=int, default=128, help="output tokens per request")
    ap.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default=name, help=name_help)
    return ap
