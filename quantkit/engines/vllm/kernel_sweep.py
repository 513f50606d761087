"""Measure an artifact in vLLM under each kernel configuration of :mod:`quantkit.engines.vllm.kernels`: one fresh
vLLM process per configuration (the environment switches are read at import), TTFT and decode tokens/s at the batch
sizes asked, each reported with the kernels vLLM's log says it used.

The processes are ``quantkit/engines/vllm/_speed_worker.py`` run with vLLM's own Python (:class:`Runtime`), each in
its own process group so a timeout or a stop kills vLLM's engine-core children too. Results are handed to
``on_update`` after every configuration, so a caller can write them out and a sweep cut short keeps what it
measured; a ``deadline`` leaves the configurations it has no time for as ``not run``. It imports the standard library
and quantkit's light tables only (no torch, no vLLM), so a GPU-machine script can drive it outside vLLM's
environment. Written for vLLM 0.26.0 on an H200; its logic is tested on CPU with real vLLM logs, the measurement
itself runs only on a GPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.engines import watch
from quantkit.engines.vllm import kernels
from quantkit.engines.vllm.kernels import Configuration, Measurement
from quantkit.progress import Reporter

CHILD = Path(__file__).with_name("_speed_worker.py")


@dataclass
class Runtime:
    """How vLLM's Python is started: the interpreter and what its environment adds (its own PYTHONPATH...)."""

    python: str = "python3"
    env: dict[str, str] = field(default_factory=lambda: {"VLLM_USE_FLASHINFER_SAMPLER": "0"})

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, **self.env, **(extra or {})}


@dataclass
class Bench:
    """What one run measures, and the engine arguments every configuration shares."""

    batches: tuple[int, ...] = (1, 16)
    prompt_len: int = 512
    gen: int = 128
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = False  # True: no CUDA graphs (starts in half the time; decode at batch 1 is slower)
    # CUDA graphs for the measured batch sizes only: a measured batch runs the same graph either way, and capturing
    # vLLM's default list (~60 sizes) lengthens every configuration's start. False: vLLM's default.
    capture_measured_only: bool = True
    # A fixed KV cache skips vLLM's memory profiling, which asserts when another process on the GPU frees memory
    # meanwhile: set it when several vLLM instances share one GPU.
    kv_cache_memory_bytes: int | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)  # e.g. {"quantization": "modelopt"}
    ttft_repeats: int = 5
    sample_prompt: str = "def parse_args(argv):\n    "
    sample_tokens: int = 32

    def request(self, model: Path, config: Configuration) -> dict[str, Any]:
        args = {"max_model_len": self.max_model_len, "gpu_memory_utilization": self.gpu_memory_utilization,
                "enforce_eager": self.enforce_eager, **self.engine_args, **config.args}
        if self.capture_measured_only and not self.enforce_eager and "compilation_config" not in args:
            args["compilation_config"] = {"cudagraph_capture_sizes": sorted(self.batches)}
        if self.kv_cache_memory_bytes:
            args["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        return {"model": str(model), "engine_args": args, "batches": list(self.batches),
                "prompt_len": self.prompt_len, "gen": self.gen, "ttft_repeats": self.ttft_repeats,
                "sample_prompt": self.sample_prompt, "sample_tokens": self.sample_tokens}

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


# ------------------------------------------------------------------------------------------------------------------
# Child processes that never outlive their caller


_groups: set[int] = set()
_groups_lock = threading.Lock()


def stop_all() -> None:
    """Kill every process group started by :func:`run_logged` and still running (for a SIGTERM handler)."""
    with _groups_lock:
        groups = list(_groups)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            watch.signal_group(pgid, sig)
        if sig == signal.SIGTERM:
            time.sleep(3)


def run_logged(argv: list[str], env: dict[str, str], log: Path, timeout: float, cwd: Path | None = None, *,
               who: str = "the child process", stall_timeout: float | None = None,
               reporter: Reporter | None = None) -> tuple[int | None, float]:
    """Run ``argv`` in its own process group with stdout and stderr into ``log``; its exit code (None when it
    ran past ``timeout``, or made no progress for ``stall_timeout`` seconds, and was stopped) and seconds.
    Whatever it left running in its group is killed too. The wait is shown (``reporter``: what it waits for, how
    long, the log's last line); a stopped child's reason is the log's last line, after a :data:`STOPPED` mark."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with _groups_lock:
            _groups.add(proc.pid)
        rc: int | None = None
        try:
            watch.wait_until(lambda: proc.poll() is not None, who=who, waits_for="finish", proc=proc, log_path=log,
                             timeout=max(1.0, timeout), stall_timeout=stall_timeout, reporter=reporter)
            rc = proc.returncode
        except watch.WaitTimedOut as e:  # past the timeout, or stalled (a WaitTimedOut too)
            watch.signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            f.write(f"\n{STOPPED} {e.message.splitlines()[0]}\n")
        finally:
            watch.signal_group(proc.pid, signal.SIGKILL)  # stragglers: vLLM's engine core, compile workers
            proc.wait()
            with _groups_lock:
                _groups.discard(proc.pid)
    return rc, time.perf_counter() - t


STOPPED = "quantkit stopped it:"


def result_line(text: str) -> dict[str, Any] | None:
    """The JSON of the last ``RESULT `` line a child printed."""
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            try:
                return json.loads(line[7:])
            except json.JSONDecodeError:
                return None
    return None


def probe_packages(runtime: Runtime, timeout: float = 60) -> frozenset[str]:
    """Which of vLLM's optional kernel packages are importable in its environment (no import, find_spec)."""
    code = ("import importlib.util as u, json; print(json.dumps([m for m in %r if u.find_spec(m)]))"
            % (list(kernels.OPTIONAL_PACKAGES),))
    try:
        out = subprocess.run([runtime.python, "-c", code], env=runtime.environ(), capture_output=True, text=True,
                             timeout=timeout)
        return frozenset(json.loads(out.stdout.strip().splitlines()[-1])) if out.returncode == 0 else frozenset()
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return frozenset()


# ------------------------------------------------------------------------------------------------------------------
# One configuration, and the sweep


def run_configuration(model: Path, config: Configuration, bench: Bench, runtime: Runtime, log: Path,
                      timeout: float) -> Measurement:
    """Start vLLM once with ``config`` and measure; the result carries the kernels its log names."""
    request = log.with_suffix(".request.json")
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_text(json.dumps(bench.request(model, config), indent=2))
    rc, seconds = run_logged([runtime.python, str(CHILD), str(request)], runtime.environ(config.env), log, timeout,
                             who=f"the vLLM load with {config.name}", stall_timeout=watch.DEFAULT_STALL_TIMEOUT)
    text = log.read_text(errors="replace")
    result = result_line(text) or {}
    facts = kernels.log_facts("\n".join(ln for ln in text.splitlines() if not ln.startswith("RESULT ")))
    m = Measurement(config, "ok", facts, seconds=round(seconds, 1), log=str(log))
    if rc is None:
        stopped = [ln[len(STOPPED):].strip() for ln in text.splitlines() if ln.startswith(STOPPED)]
        m.status, m.error = "timeout", (stopped[-1] if stopped else f"no result within {timeout:.0f} s") + (
            f" ({facts.error})" if facts.error else "")
    elif rc != 0 or "error" in result or "batches" not in result:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        m.status = "failed"
        m.error = facts.error or result.get("error") or (lines[-1][:300] if lines else f"exit {rc}, no output")
    if "batches" in result:
        m.ttft_s = result.get("ttft_s")
        m.decode_tok_s = {b: round(v["decode_tok_s"], 1) for b, v in result["batches"].items()
                          if v.get("decode_tok_s")}
    m.extra = {k: v for k, v in result.items() if k not in ("batches", "ttft_s", "error", "sample_ids")}
    if "batches" in result:  # each timed generation's figure, so a reader sees the spread behind the median
        m.extra["decode_tok_s_runs"] = {b: v["decode_tok_s_runs"] for b, v in result["batches"].items()
                                        if v.get("decode_tok_s_runs")}
    return m


@dataclass
class SweepResult:
    """A whole sweep: what the artifact is, what could run it, what each configuration measured, the choice."""

    artifact: str
    quantization: kernels.Quantization
    packages: list[str]
    candidates: list[dict[str, Any]]
    bench: Bench
    measurements: list[Measurement] = field(default_factory=list)
    choice: kernels.Choice | None = None
    command: kernels.ServeCommand | None = None

    def to_json(self) -> dict[str, Any]:
        return {"artifact": self.artifact, "vllm_read": kernels.VLLM_VERSION,
                "quantization": self.quantization.to_json(),
                "packages": self.packages, "candidates": self.candidates, "bench": self.bench.to_json(),
                "measurements": [m.to_json() for m in self.measurements],
                "choice": self.choice.to_json() if self.choice else None,
                "command": self.command.to_json() if self.command else None}

    def markdown(self) -> str:
        return kernels.markdown(self.measurements, self.choice, self.bench.batches)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "config"


def sweep(artifact: Path, bench: Bench, runtime: Runtime, log_dir: Path, *, force: str = "env", batch: int = 1,
          min_gain: float = 0.03, timeout: float = 600, deadline: float | None = None,
          only: list[str] | None = None, on_update: Callable[[SweepResult], None] | None = None,
          stop: threading.Event | None = None) -> SweepResult:
    """Run every kernel configuration of ``artifact`` (or those named in ``only``), one vLLM process each, and
    choose. ``deadline`` is a ``time.monotonic()`` value: configurations that would start after it, or after
    ``stop`` is set, are recorded as ``not run``. When the best linear kernel and the best MoE backend were
    measured apart, their combination is run last if time allows."""
    q = kernels.read_quantization(artifact)
    packages = probe_packages(runtime)
    configs = kernels.configurations(q, packages, force)
    if only:
        configs = [c for c in configs if c.name in only or c.kind == "default"]
    result = SweepResult(str(artifact), q, sorted(packages),
                         [{"layer": s.layer, "moe": moe, "kernels": [c.to_json() for c in
                                                                     kernels.assess(s, q.dtype, packages, moe)]}
                          for s in q.schemes for moe in ((False, True) if q.moe else (False,))], bench)
    extra = ["--quantization", str(bench.engine_args["quantization"])] if bench.engine_args.get("quantization") else []

    def run(config: Configuration) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if stop is not None and stop.is_set():
            result.measurements.append(Measurement(config, "not run", error="stopped"))
        elif left is not None and left < 30:
            result.measurements.append(Measurement(config, "not run", error="time budget spent"))
        else:
            limit = timeout if left is None else min(timeout, left)
            result.measurements.append(run_configuration(artifact, config, bench, runtime,
                                                         log_dir / f"{_safe(config.name)}.log", limit))
        result.choice = kernels.choose(result.measurements, batch, min_gain)
        result.command = kernels.serve_command(str(artifact), result.choice.configuration, extra) \
            if result.choice else None
        if on_update:
            on_update(result)

    for config in configs:
        run(config)
    if result.choice and not result.choice.measured:
        run(result.choice.configuration)
    return result
