"""Several GPUs: the same job under torchrun (llm-compressor's distributed oneshot: data-parallel calibration,
weight-parallel GPTQ), each rank running :mod:`quantkit.producers.oneshot`'s load, run, check and save.

``python -m quantkit.producers.torchrun JOB.json RESULT.json`` is one rank: it reads the :class:`Job`, and rank 0
writes what the manifest should know about the run.
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
from quantkit.producers import oneshot
from quantkit.producers.job import Job
from quantkit.producers.modifiers import plan


def distributed(job: Job, num_gpus: int) -> dict[str, Any]:
    """Run the job on ``num_gpus`` GPUs with llm-compressor's distributed oneshot, launched through torchrun.

    Each rank loads the model through compressed-tensors' offloaded load (rank 0 reads, the others share), calibrates
    its share of the samples (oneshot partitions an identical Dataset by itself), and rank 0 writes the files.
    """
    with tempfile.TemporaryDirectory(prefix="quantkit-ddp-") as work:
        job_path, result_path = Path(work) / "job.json", Path(work) / "result.json"
        job_path.write_text(job.model_dump_json())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_gpus}",
               "-m", "quantkit.producers.torchrun", str(job_path), str(result_path)]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0 or not result_path.exists():
            raise BackendError(f"distributed quantization on {num_gpus} GPUs failed (torchrun exit {proc.returncode})",
                               hint="its log is above; --num-gpus 1 runs the same job in one process")
        return json.loads(result_path.read_text())


def _worker(job_path: str, result_path: str) -> None:
    """One torchrun rank (``python -m quantkit.producers.torchrun JOB RESULT``)."""
    import torch.distributed as dist
    from compressed_tensors.offload import init_dist
    from transformers import AutoTokenizer

    job = Job.model_validate_json(Path(job_path).read_text())
    init_dist()
    p = plan(job.spec)
    model = oneshot.load_model(job, distributed=True)
    info = oneshot.run(model, p, job)
    info["coverage"] = oneshot.check(model, p, job)
    first = dist.get_rank() == 0
    tokenizer = AutoTokenizer.from_pretrained(job.source, trust_remote_code=job.trust_remote_code) if first else None
    oneshot.save(model, tokenizer, job, p.save_format)
    if first:
        Path(result_path).write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
