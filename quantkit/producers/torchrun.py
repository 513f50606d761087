"""Several GPUs: the same job under torchrun (llm-compressor's distributed oneshot: data-parallel calibration,
weight-parallel GPTQ), each rank running :mod:`quantkit.producers.oneshot`'s load, run, check and save.

``python -m quantkit.producers.torchrun JOB`` is one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError
from quantkit.producers import coverage, moe, vision
from quantkit.producers.modifiers import plan
from quantkit.producers.oneshot import SHARD_SIZE, load_model, run


def distributed(job: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    """Run the job on ``num_gpus`` GPUs with llm-compressor's distributed oneshot, launched through torchrun.

    Each rank loads the model through llm-compressor's ``load_context`` (rank 0 reads, the others share), calibrates
    its share of the samples (oneshot partitions an identical Dataset by itself), and rank 0 writes the files.
    """
    with tempfile.TemporaryDirectory(prefix="quantkit-ddp-") as work:
        job_path, result_path = Path(work) / "job.json", Path(work) / "result.json"
        job_path.write_text(json.dumps({**job, "result": str(result_path)}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_gpus}",
               "-m", "quantkit.producers.torchrun", str(job_path)]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0 or not result_path.exists():
            raise BackendError(f"distributed quantization on {num_gpus} GPUs failed (torchrun exit {proc.returncode})",
                               hint="its log is above; --num-gpus 1 runs the same job in one process")
        return json.loads(result_path.read_text())


def _spec_from(job: dict[str, Any]) -> Any:
    from pydantic import TypeAdapter

    from quantkit.recipe import MethodSpec

    return TypeAdapter(MethodSpec).validate_python(job["spec"])


def _worker(job_path: str) -> None:
    """One torchrun rank (``python -m quantkit.producers.torchrun JOB``)."""
    import torch.distributed as dist
    from compressed_tensors.offload import init_dist
    from transformers import AutoTokenizer

    job = json.loads(Path(job_path).read_text())
    init_dist()
    p = plan(_spec_from(job))
    model = load_model(job, distributed=True)
    info = run(model, p, job)
    cov = coverage.check(model, job["ignore"], job["config"], p.signed_scales)
    cov.raise_for_failures()
    info["coverage"] = cov.manifest()
    fam = moe.family(job["config"])
    if fam:
        moe.save_as_checkpoint(model, fam)
    model.save_pretrained(job["out"], save_compressed=True, quantization_format=p.save_format,  # rank 0 writes
                          max_shard_size=SHARD_SIZE)
    if dist.get_rank() == 0:
        AutoTokenizer.from_pretrained(job["source"], trust_remote_code=job["trust_remote_code"]).save_pretrained(
            job["out"])
        if vision.family(job["config"]):
            vision.record_ignored(Path(job["out"]), model, job["ignore"])
        Path(job["result"]).write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
