"""The vLLM engine: ``prompt_logprobs`` for the protocol's token windows, computed in a vLLM subprocess.

Written against the vLLM V1 offline API (``LLM.generate`` with ``TokensPrompt`` and
``SamplingParams(prompt_logprobs=k)``); it needs a CUDA GPU and could not be run where quantkit's CPU test
suite runs, so its test is skipped without CUDA.

vLLM runs with its own Python (``--python``, or ``QUANTKIT_VLLM_PYTHON``, or this interpreter when vLLM is
importable here), so it may pin a different torch than quantkit's. The worker script
(:mod:`quantkit.engines.vllm._logits_worker`) is run as a plain file and imports nothing from quantkit. Windows are
passed as token ids in a ``.npz`` file; the worker writes one ``.npz`` per window and announces it on its
stdout, so results stream back (and are compared, on the baseline's device) while vLLM works through the next
batch. The worker reads vLLM's answers as arrays (``FlatLogprobs``) and reports the seconds ``llm.generate`` itself
took, so evaluation can say how close its scoring runs to vLLM's own prompt-logprob throughput
(:meth:`VllmEngine.scoring_facts`).

What comes back is sparse: per scored position, the top-k token ids with their log-probabilities (vLLM's raw
log-probabilities, before any sampling processing) and the log-probability of the actual next token. So
perplexity and top-1 agreement are exact, while KL divergence is a lower bound computed over the top-k bins
plus one bin for the rest of the vocabulary (see :func:`quantkit.evaluation.metrics.kld_rows`). ``QUANTKIT_VLLM_ARGS``
(JSON) adds keyword arguments to ``vllm.LLM`` (``tensor_parallel_size``, ``gpu_memory_utilization``...).

An FP4 W4A4 artifact's numerics are steered by ``EngineOptions.numerics`` (vLLM's NVFP4 emulation kernel, or Marlin
FP4) and read back from the kernels vLLM's log names at load (:mod:`quantkit.engines.numerics`).
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from quantkit.engines import numerics, registry, watch
from quantkit.engines.logits import EngineOptions, LogProbs, Window
from quantkit.engines.vllm import kernels
from quantkit.errors import BackendError, UsageError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import VLLM
from quantkit.progress import command_reporter

WORKER = Path(__file__).with_name("_logits_worker.py")
ROW = registry.get(VLLM)
PYTHON_ENV = ROW.env_var
ARGS_ENV = "QUANTKIT_VLLM_ARGS"


def find_python(explicit: str | None) -> str:
    """vLLM's interpreter, refused early when it cannot run the worker (:meth:`quantkit.engines.registry.Engine.require_python`)."""
    return ROW.require_python(explicit)


def refuse(path: Path, kind: Kind) -> None:
    """What vLLM cannot score at all (:func:`quantkit.engines.logits.check_compatible` asks, before any load)."""
    if why := kernels.vllm_refusal(path):
        raise UsageError(why, hint="build its TensorRT-LLM engine (quantkit build-trt) and smoke-test that, or "
                         "export FP8 for vLLM")


def _engine_args() -> dict[str, Any]:
    raw = os.environ.get(ARGS_ENV)
    if not raw:
        return {}
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UsageError(f"{ARGS_ENV} is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise UsageError(f"{ARGS_ENV} must be a JSON object of vllm.LLM keyword arguments")
    return args


class VllmEngine:
    """A vLLM worker process holding the model; windows go in as token ids, top-k log-probs come out."""

    name = VLLM

    def __init__(self, path: Path, options: EngineOptions) -> None:
        if options.device == "cpu":
            raise UsageError("the vLLM engine runs on a GPU; --device cpu cannot be honoured",
                             hint="use --engine transformers for CPU evaluation")
        self.path = path
        self.topk = options.topk
        self.python = find_python(options.python)
        self.tmp = Path(tempfile.mkdtemp(prefix="quantkit-vllm-"))
        # The log lives outside the scratch folder so it survives a failure for the user to read.
        self.log_path = self.tmp.with_suffix(".log")
        self._failed = False
        self.fp4 = numerics.w4a4(path)
        steer = numerics.vllm_args(options.numerics, kernels.read_quantization(path).moe) if self.fp4 else {}
        self.numerics_asked = options.numerics
        request = {"model": str(path), "max_model_len": options.ctx + 1, "topk": self.topk,
                   "engine_args": {**_engine_args(), **steer}}
        (self.tmp / "request.json").write_text(json.dumps(request))
        self._log: IO[str] = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen([self.python, str(WORKER), str(self.tmp / "request.json")],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                         start_new_session=True)
        except OSError as e:
            self._log.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise BackendError(f"cannot start vLLM's Python {self.python}: {e}") from None
        try:
            line = self._wait_ready(options.stall_timeout)
        except BaseException:
            self._failed = True
            self.close()
            raise
        self._info = json.loads(line.partition(" ")[2] or "{}")
        self._facts: dict[str, Any] = {}

    def _wait_ready(self, stall_timeout: float | None) -> str:
        """The worker's READY line, waited for as every engine start is (:func:`quantkit.engines.watch.wait_until`):
        the wait shows how long vLLM has been loading and its log's last line, and a worker that makes no progress
        for ``stall_timeout`` seconds is stopped and named. No overall bound: a large model's load is long but never
        silent (its log and GPU memory move), and the stall is what a hung load shows."""
        assert self.proc.stdout is not None
        pipe = self.proc.stdout
        watch.wait_until(lambda: bool(select.select([pipe], [], [], 0)[0]), who=f"vLLM's worker for {self.path.name}",
                         waits_for="load the model", proc=self.proc, log_path=self.log_path, timeout=math.inf,
                         stall_timeout=stall_timeout, reporter=command_reporter())
        return self._expect("READY")

    def _expect(self, word: str) -> str:
        """The next protocol line, which must start with ``word``; a dead worker becomes a BackendError."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            self._failed = True
            self.proc.wait(timeout=60)
            self._log.flush()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
            raise BackendError(f"vLLM failed on {self.path} (exit {self.proc.returncode}):\n    " + "\n    ".join(tail),
                               hint=f"the full log is {self.log_path}")
        return line.strip()

    def info(self) -> dict[str, Any]:
        out = {"engine": self.name, "version": self._info.get("version"), "device": self._info.get("device"),
               "model": str(self.path), "python": self.python, "topk": self.topk}
        if self.fp4 is not None:  # which arithmetic the W4A4 artifact got, from the kernels vLLM says it loaded
            self._log.flush()
            used = [k for _, k in kernels.log_facts(self.log_path.read_text(errors="replace")).linear]
            found = numerics.of_vllm_kernels(used, self.numerics_asked)
            out["numerics_line"] = numerics.line(self.fp4, found, f"vLLM on {out['device']}") if found else \
                f"vLLM's log names no FP4 kernel for this {self.fp4.layout} W4A4 artifact: which arithmetic its " \
                "scores measured is not known"
            if found:
                out["numerics"] = found
        return out

    def logits(self, windows: Sequence[Window]) -> Iterator[LogProbs]:
        if not windows:
            return
        out_dir = self.tmp / "out"
        out_dir.mkdir(exist_ok=True)
        lengths = [len(w.tokens) for w in windows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.fromiter((t for w in windows for t in w.tokens), dtype=np.int32, count=int(offsets[-1]))
        windows_path = self.tmp / "windows.npz"
        np.savez(windows_path, tokens=flat, offsets=offsets, score_from=np.array([w.score_from for w in windows]),
                 index=np.array([w.index for w in windows]))
        self._send([str(windows_path), str(out_dir)])
        for w in windows:
            line = self._expect("WINDOW")
            if int(line.split()[1]) != w.index:
                raise BackendError(f"vLLM worker answered window {line.split()[1]}, expected {w.index}")
            result = out_dir / f"w{w.index}.npz"
            with np.load(result) as data:
                lp = LogProbs(ids=data["ids"].astype(np.int64), values=data["values"], target=data["target"])
            result.unlink()
            yield lp
        self._facts = self._done()

    def scoring_facts(self) -> dict[str, Any]:
        """vLLM's own share of the last scoring: the seconds inside ``llm.generate`` with ``prompt_logprobs`` (its
        own prompt-logprob throughput on these tokens) and the worker's conversion of its answers."""
        return {f"vllm_{k}": round(v, 3) if isinstance(v, float) else v for k, v in self._facts.items()}

    def prefill_seconds(self, windows: Sequence[Window]) -> float:
        """Seconds vLLM takes to run ``windows`` without prompt log-probabilities: the floor under scoring them."""
        path = self.tmp / "prefill.npz"
        offsets = np.concatenate([[0], np.cumsum([len(w.tokens) for w in windows])]).astype(np.int64)
        np.savez(path, tokens=np.fromiter((t for w in windows for t in w.tokens), dtype=np.int32,
                                          count=int(offsets[-1])), offsets=offsets)
        self._send({"prefill": str(path)})
        return float(self._done()["generate_s"])

    def _send(self, request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def _done(self) -> dict[str, Any]:
        """The worker's DONE line and the timings it carries."""
        facts = json.loads(self._expect("DONE").partition(" ")[2] or "{}")
        return facts if isinstance(facts, dict) else {}

    def image_logprobs(self, prompts: Sequence[tuple[list[int], Path, int]]) -> list[LogProbs]:
        """Top-k log-probabilities at the answer positions of image prompts: (prompt with one image placeholder
        followed by the answer, the image file, answer length) each; vLLM's own processor expands the image."""
        out_dir = self.tmp / "images"
        out_dir.mkdir(exist_ok=True)
        request = self.tmp / "images.json"
        request.write_text(json.dumps([{"tokens": list(map(int, t)), "image": str(img), "answer": int(n), "index": i}
                                       for i, (t, img, n) in enumerate(prompts)]))
        self._send({"images": str(request), "out": str(out_dir)})
        out = []
        for i in range(len(prompts)):
            self._expect(f"IMAGE {i}")
            with np.load(out_dir / f"i{i}.npz") as data:
                out.append(LogProbs(ids=data["ids"].astype(np.int64), values=data["values"], target=data["target"]))
        self._expect("DONE")
        return out

    def close(self) -> None:
        """Ask the worker to finish (it frees the GPU); one that failed, stalled or does not finish within a minute
        is killed with its process group (vLLM's engine core runs in a process of its own)."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None and not self._failed:
            try:
                if proc.stdin:
                    proc.stdin.write("\n")
                    proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc is not None:
            watch.signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if not self._failed:
            self.log_path.unlink(missing_ok=True)


def load(path: Path, options: EngineOptions) -> VllmEngine:
    return VllmEngine(path, options)
