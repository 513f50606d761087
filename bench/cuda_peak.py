"""Run a Python program in this process and, when it exits, write torch's peak allocated CUDA memory to a file: the
figure nvidia-smi cannot give (it sees the allocator's reserve and the CUDA context too), for a program that is not
ours to edit (quantkit's CLI, llm-compressor's script).

    python bench/cuda_peak.py PEAK.json -m quantkit gptq SRC OUT ...     # a module, as python -m runs it
    python bench/cuda_peak.py PEAK.json SCRIPT.py ARGS ...               # a script

PEAK.json gets {"max_memory_allocated": bytes, "max_memory_reserved": bytes} per visible GPU (summed), or nulls
where the program never initialised CUDA. The program's exit status is this process's. Standard library and torch
(imported only if the program imported it).
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
from pathlib import Path


def _write(path: Path) -> None:
    torch = sys.modules.get("torch")
    peak: dict[str, int | None] = {"max_memory_allocated": None, "max_memory_reserved": None}
    if torch is not None and torch.cuda.is_initialized():
        devices = range(torch.cuda.device_count())
        peak = {"max_memory_allocated": sum(torch.cuda.max_memory_allocated(d) for d in devices),
                "max_memory_reserved": sum(torch.cuda.max_memory_reserved(d) for d in devices)}
    path.write_text(json.dumps(peak))


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: cuda_peak.py PEAK.json (-m MODULE | SCRIPT) ARGS...")
    atexit.register(_write, Path(sys.argv[1]))
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3], *sys.argv[4:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
