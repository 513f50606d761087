"""How long quantkit's sealing (sha256 + fsync of every file) holds up an artifact after its weights are written.

An 8B FP8 save on the H200 host writes three shards (4 + 4 + 1 GB) in about 2.4 s, and quantkit then spent 4.5 s
sealing them (``bench/results/h200/8b/``). This reproduces that pattern without a model: ``safetensors`` writes
N shards back to back into a folder (its own ``.tmp`` + rename), as ``save_pretrained`` does, and the script times

* ``write``: the shards written, nothing else (what llm-compressor called directly pays);
* ``after``: then hashing and fsyncing them all (quantkit before it sealed while writing);
* ``sealer``: :class:`quantkit.seal.Sealer` watching the folder while it is written, then ``finish()``.

Each run starts from a dropped page cache where the machine allows it (root), else from whatever is cached.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

from quantkit import seal  # noqa: E402


def make_tensors(sizes: list[int]) -> list[Any]:
    """One uint8 tensor per shard, made once: what they hold changes neither hashing nor writing speed (no
    compression anywhere), and random fill of 9 GB alone took minutes."""
    import torch

    return [torch.full((size,), 7, dtype=torch.uint8) for size in sizes]


def write_shards(folder: Path, tensors: list[Any]) -> float:
    """Write one safetensors file per tensor back to back; seconds taken."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        save_file({"weight": t}, str(folder / f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"))
    return time.perf_counter() - t0


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def one(mode: str, tensors: list[Any], workdir: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        folder = Path(d)
        drop_caches()
        sealer = seal.Sealer(folder, lambda p: True).start() if mode == "sealer" else None
        written = write_shards(folder, tensors)
        t0 = time.perf_counter()
        if sealer is not None:
            sealer.finish()
        elif mode == "after":
            files = sorted(folder.iterdir())
            dict(seal.hash_many(files))
            for f in files:
                seal.fsync_file(f)
        sealed = time.perf_counter() - t0
        return {"write_s": written, "seal_s": sealed, "total_s": written + sealed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="4,4,1", help="shard sizes in GB, written in this order")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--name", default="seal_speed")
    ap.add_argument("--results-dir", type=Path, default=meta.RESULTS)
    args = ap.parse_args()
    tensors = make_tensors([int(float(x) * 1e9) for x in args.shards.split(",")])
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in ("write", "after", "sealer")}
    for i in range(args.repeat):
        for mode in runs:  # interleaved, so drift on a shared machine hits every mode alike
            runs[mode].append(one(mode, tensors, args.workdir))
            print(f"run {i + 1} {mode}: {runs[mode][-1]}", flush=True)
        md = report(args, runs)  # after every round: a run cut short still leaves its rounds behind
    print(md)


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, float]]]) -> str:
    """Write NAME.json and NAME.md from the runs so far; the table."""
    summary: dict[str, Any] = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    n = len(runs["write"])
    data = {**meta.header(), "shards_gb": args.shards, "repeat": n, "runs": runs, "median": summary}
    base = summary["write"]["total_s"]
    rows = [f"| {m} | {s['write_s']:.2f} s | {s['seal_s']:.2f} s | {s['total_s']:.2f} s | "
            f"{(s['total_s'] / base - 1) * 100:+.0f}% |" for m, s in summary.items()]
    md = "\n".join([
        "# Sealing an artifact's files: after the save, or while it is written", "", meta.md_header(data).rstrip(),
        "", f"Shards of {args.shards} GB written by safetensors back to back; medians of {n} runs, modes "
        "interleaved. `write`: the shards only; `after`: then sha256 + fsync of every file; `sealer`: "
        "quantkit.seal.Sealer watching while they are written, then `finish()`.", "",
        "| mode | write | seal (after the last shard) | total | over write |", "|---|---|---|---|---|", *rows, ""])
    meta.write(args.name, data, md, args.results_dir)
    return md


if __name__ == "__main__":
    main()
