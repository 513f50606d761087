#!/usr/bin/env python3
"""Run the GPU end-to-end cases of scripts/gpu_cases.yaml: produce each artifact with the real quantkit CLI, load it
in vLLM, serve it, score it, sweep its kernels, and check every expectation (issue 13).

On the GPU machine, from the repository root, with vLLM 0.26.0 in /tmp/site (../shared/device/vllm/README.md),
llm-compressor in /tmp/site-llmc (../shared/device/llmcompressor/README.md) and, for the ModelOpt cases, the
ModelOpt environment in /tmp/site-trt (scripts/trt_env.sh):

    setsid nohup python3 scripts/gpu_cases.py --out /tmp/qk-gpu --budget 1200 \
        > /tmp/qk-gpu.log 2>&1 < /dev/null &
    python3 scripts/gpu_cases.py --status --out /tmp/qk-gpu             # poll: progress and the table so far
    python3 scripts/gpu_cases.py --wait 540 --collect "$OUT" --out /tmp/qk-gpu
                          # block until the run ends (or 540 s), print its status, copy results + logs to $OUT

``--dry-run`` prints every command a run would start, without starting any. Per case, in order:

1. the source model: a folder, or ``shape:NAME`` (random weights, built once into ``--models-dir``, shared with
   bench/quantize_cost.py);
2. the artifact: ``python3 -m quantkit VERB MODEL ART --force --json ...`` (or ``build-trt`` on a recipe copy whose
   model and output are set), with PYTHONPATH=REPO:``--quantkit-site``; an artifact already built by the same
   command is reused (``--rebuild`` redoes it), and cases with the same command share it;
3. the load: quantkit/serve/_vllm_speed.py in vLLM's environment (PYTHONPATH=``--vllm-site``): vLLM's
   quantization method, the linear and MoE kernels its log names, TTFT and decode tok/s at the case's batch sizes;
   with ``sweep:``, one such load per kernel configuration instead (quantkit.serve.kernel_sweep);
4. ``quantkit smoke --engine vllm`` (the real ``vllm serve``) and ``quantkit eval --engine vllm`` where the case
   asks for them;
5. the checks: loads, quantization, kernel, MoE kernel, tok/s floors, smoke, doctor's prediction against vLLM's
   own verdict, KLD, perplexity ratio, top-1.

Results are rewritten after every step: OUT/results.json (everything), OUT/results.md (the table),
OUT/progress.log, OUT/logs/CASE/ (each process's log). Cases run ``--parallel`` at once on one GPU, each vLLM with
``--mem-share`` of its memory and a fixed ``--kv-cache-gib`` KV cache (which skips vLLM's start-up memory
profiling: it asserts when another process frees GPU memory meanwhile), vLLM starts ``--stagger`` seconds apart;
a case marked ``exclusive`` runs its load or sweep with nothing else on the GPU (and lets vLLM size its cache).
No case starts once the ``--budget`` left is under its ``estimate_s``: those are listed as ``not run``;
``--resume`` keeps the finished cases of an earlier run in the same OUT. SIGTERM stops every child process group
and writes the results. One runner per OUT. The parent needs Python 3.10+ and PyYAML (the image has it; quantkit
depends on it) and imports only quantkit.serve.kernels/kernel_sweep; the heavy work happens in child processes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from quantkit.serve import kernel_sweep, kernels  # noqa: E402
from shapes import SHAPES  # noqa: E402

CASES = Path(__file__).with_name("gpu_cases.yaml")
VERBS = ("awq", "gptq", "fp8", "int8", "rtn", "build-trt")
NEEDS = ("trt",)
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
FINISHED = ("pass", "fail", "error", "skipped")


class CaseError(Exception):
    """A case file that cannot be run: one line saying where and what."""


# ------------------------------------------------------------------------------------------------------------------
# The case file


@dataclass
class Produce:
    verb: str
    args: list[str] = field(default_factory=list)
    recipe: str | dict[str, Any] | None = None
    serve: str | None = None


@dataclass
class Measure:
    """The load (or, with force/only, the sweep) of a case."""

    batches: list[int] = field(default_factory=lambda: [1, 16])
    prompt_len: int = 128
    gen: int = 64
    max_model_len: int = 1024
    enforce_eager: bool = True
    engine_args: dict[str, Any] = field(default_factory=dict)
    timeout: float = 300
    force: str = "env"
    only: list[str] = field(default_factory=list)


@dataclass
class Smoke:
    args: list[str] = field(default_factory=list)
    timeout: float = 420


@dataclass
class Eval:
    max_tokens: int = 32768
    ctx: int = 2048
    dataset: str = "heldout"
    timeout: float = 420


@dataclass
class Expect:
    loads: bool = True
    quantization: str | None = None
    kernel: str | None = None
    moe_kernel: str | None = None
    min_tok_s: dict[int, float] = field(default_factory=dict)
    smoke: bool | None = None
    max_kld: float | None = None
    max_ppl_ratio: float | None = None
    min_top1: float | None = None


@dataclass
class Case:
    name: str
    produce: Produce
    model: str = "models/quantkit-tiny"
    tags: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    load: Measure = field(default_factory=Measure)
    smoke: Smoke | None = None
    eval: Eval | None = None
    sweep: Measure | None = None
    expect: Expect = field(default_factory=Expect)
    gpu_memory_utilization: float | None = None
    exclusive: bool = False
    estimate_s: float = 120
    artifact: str = ""  # the artifact folder's name: the first case with the same produce command


SWEEP_DEFAULTS = {"prompt_len": 512, "gen": 128, "max_model_len": 2048, "enforce_eager": False, "timeout": 600}
# field -> kind: str, bool, int, num, strs, ints, map (any mapping), tokmap ({batch: number}), recipe, or a section
SECTIONS: dict[str, tuple[type, dict[str, Any]]] = {
    "produce": (Produce, {"verb": VERBS, "args": "strs", "recipe": "recipe", "serve": "str"}),
    "load": (Measure, {"batches": "ints", "prompt_len": "int", "gen": "int", "max_model_len": "int",
                       "enforce_eager": "bool", "engine_args": "map", "timeout": "num"}),
    "sweep": (Measure, {"batches": "ints", "prompt_len": "int", "gen": "int", "max_model_len": "int",
                        "enforce_eager": "bool", "engine_args": "map", "timeout": "num", "force": ("env", "backend"),
                        "only": "strs"}),
    "smoke": (Smoke, {"args": "strs", "timeout": "num"}),
    "eval": (Eval, {"max_tokens": "int", "ctx": "int", "dataset": "str", "timeout": "num"}),
    "expect": (Expect, {"loads": "bool", "quantization": "str", "kernel": "pattern", "moe_kernel": "pattern",
                        "min_tok_s": "tokmap", "smoke": "bool", "max_kld": "num", "max_ppl_ratio": "num",
                        "min_top1": "num"}),
}
TOP = {"name": "str", "model": "str", "tags": "strs", "needs": "strs", "gpu_memory_utilization": "num",
       "exclusive": "bool", "estimate_s": "num", **{k: "section" for k in SECTIONS}}


def _lines(node: yaml.Node, path: tuple = ()) -> dict[tuple, int]:
    """YAML path -> line number, for messages that say where."""
    out = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            out.update(_lines(value, path + (key.value,)))
            out[path + (key.value,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            out.update(_lines(value, path + (i,)))
    return out


class _Reader:
    """Validates one case file, raising CaseError with file, line and path."""

    def __init__(self, path: Path, lines: dict[tuple, int]) -> None:
        self.path, self.lines = path, lines

    def fail(self, where: tuple, what: str) -> None:
        line = next((self.lines[where[:i]] for i in range(len(where), -1, -1) if where[:i] in self.lines), None)
        label = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in where).replace(".[", "[")
        raise CaseError(f"{self.path}:{line}: {label}: {what}")

    def value(self, where: tuple, kind: Any, v: Any) -> Any:
        if isinstance(kind, tuple):
            if v not in kind:
                self.fail(where, f"expected one of {', '.join(kind)}; got {v!r}")
            return v
        ok = {"str": isinstance(v, str), "bool": isinstance(v, bool), "map": isinstance(v, dict),
              "int": isinstance(v, int) and not isinstance(v, bool),
              "num": isinstance(v, (int, float)) and not isinstance(v, bool),
              "strs": isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v),
              "ints": isinstance(v, list) and bool(v) and all(isinstance(x, int) and x > 0 for x in v),
              "tokmap": isinstance(v, dict) and all(isinstance(k, int) and isinstance(x, (int, float))
                                                    for k, x in v.items()),
              "recipe": isinstance(v, (str, dict)), "pattern": isinstance(v, str)}[kind]
        if not ok:
            want = {"strs": "a list of strings", "ints": "a non-empty list of positive integers", "map": "a mapping",
                    "tokmap": "a mapping of batch size to tokens/s", "recipe": "a recipe file or mapping",
                    "num": "a number", "int": "an integer", "pattern": "a substring or /regex/"}.get(kind, f"a {kind}")
            self.fail(where, f"expected {want}; got {v!r}")
        if kind == "strs":
            return [str(x) for x in v]
        if kind == "pattern" and len(v) > 1 and v.startswith("/") and v.endswith("/"):
            try:
                re.compile(v[1:-1])
            except re.error as e:
                self.fail(where, f"not a valid regular expression: {e}")
        return v

    def section(self, where: tuple, name: str, raw: Any, base: Any = None) -> Any:
        cls, spec = SECTIONS[name]
        if raw is None or raw is True:
            raw = {}
        if not isinstance(raw, dict):
            self.fail(where, f"expected a mapping; got {raw!r}")
        values = dict(base.__dict__) if base is not None else {}
        for key, v in raw.items():
            if key not in spec:
                self.fail(where + (key,), f"unknown key; expected one of {', '.join(spec)}")
            values[key] = self.value(where + (key,), spec[key], v)
        if name == "produce" and "verb" not in values:
            self.fail(where, "needs a verb (one of " + ", ".join(VERBS) + ")")
        return cls(**values)

    def case(self, i: int, raw: Any, defaults: dict[str, Any]) -> Case:
        where: tuple = ("cases", i)
        if not isinstance(raw, dict):
            self.fail(where, f"a case is a mapping; got {raw!r}")
        merged = {**defaults, **raw}
        for key in ("load", "expect"):  # sections merge key by key with the defaults'
            if isinstance(defaults.get(key), dict) and isinstance(raw.get(key), dict):
                merged[key] = {**defaults[key], **raw[key]}
        for key in merged:
            if key not in TOP:
                self.fail(where + (key,), f"unknown key; expected one of {', '.join(TOP)}")
        if "name" not in raw:
            self.fail(where, "needs a name")
        if "produce" not in merged:
            self.fail(where, "needs produce: {verb: ...}")
        fields: dict[str, Any] = {}
        for key, v in merged.items():
            at = where + (key,) if key in raw else ("defaults", key)
            if key == "sweep":
                fields[key] = self.section(at, key, v, Measure(**SWEEP_DEFAULTS))
            elif TOP[key] == "section":
                fields[key] = self.section(at, key, v)
            else:
                fields[key] = self.value(at, TOP[key], v)
        case = Case(**fields)
        self.check(where, case, raw)
        return case

    def check(self, where: tuple, c: Case, raw: dict[str, Any]) -> None:
        """Rules across fields."""
        if not NAME.match(c.name):
            self.fail(where + ("name",), f"use letters, digits, '.', '_' and '-' only; got {c.name!r}")
        if c.produce.verb == "build-trt" and c.produce.recipe is None:
            self.fail(where + ("produce",), "build-trt needs a recipe (file or mapping)")
        if c.produce.recipe is not None and c.produce.verb != "build-trt":
            self.fail(where + ("produce", "recipe"), "only build-trt takes a recipe; give other verbs args")
        if isinstance(c.produce.recipe, str) and not (REPO / c.produce.recipe).is_file():
            self.fail(where + ("produce", "recipe"), f"no recipe file {c.produce.recipe} in the repository")
        if c.model.startswith("shape:"):
            if c.model[6:] not in SHAPES:
                self.fail(where + ("model",), f"unknown shape {c.model[6:]!r}; bench/shapes.py has "
                          + ", ".join(SHAPES))
        elif not (REPO / c.model / "config.json").is_file():
            self.fail(where + ("model",), f"no checkpoint (config.json) at {c.model}")
        for need in c.needs:
            if need not in NEEDS:
                self.fail(where + ("needs",), f"unknown need {need!r}; known: {', '.join(NEEDS)}")
        e = c.expect
        measured = c.sweep.batches if c.sweep else c.load.batches
        for b in e.min_tok_s:
            if b not in measured:
                self.fail(where + ("expect", "min_tok_s"), f"batch {b} is not measured (batches {measured})")
        if e.smoke is not None and c.smoke is None:
            self.fail(where + ("expect", "smoke"), "needs a smoke: section")
        for key in ("max_kld", "max_ppl_ratio", "min_top1"):
            if getattr(e, key) is not None and c.eval is None:
                self.fail(where + ("expect", key), "needs an eval: section")
        share = c.gpu_memory_utilization
        if share is not None and not 0 < share < 1:
            self.fail(where + ("gpu_memory_utilization",), f"expected a fraction in (0, 1); got {share}")


def load_cases(path: Path) -> list[Case]:
    """Read and validate a case file: a list of cases, or CaseError naming the first problem."""
    try:
        text = path.read_text()
    except OSError as e:
        raise CaseError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        lines = _lines(yaml.compose(text) or yaml.ScalarNode("", ""))
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise CaseError(f"{path}:{mark.line + 1 if mark else '?'}: not valid YAML: "
                        f"{getattr(e, 'problem', None) or e}") from None
    reader = _Reader(path, lines)
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list) or not data["cases"]:
        reader.fail((), "expected a mapping with a non-empty list under 'cases:' (and optional 'defaults:')")
    for key in data:
        if key not in ("defaults", "cases"):
            reader.fail((key,), "unknown key; expected defaults or cases")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict) or "name" in defaults:
        reader.fail(("defaults",), "expected a mapping of case keys (without name)")
    for key in defaults:
        if key not in TOP:
            reader.fail(("defaults", key), f"unknown key; expected one of {', '.join(TOP)}")
    cases = [reader.case(i, raw, defaults) for i, raw in enumerate(data["cases"])]
    seen: dict[str, int] = {}
    producers: dict[str, str] = {}
    for i, c in enumerate(cases):
        if c.name in seen:
            reader.fail(("cases", i, "name"), f"{c.name!r} is also the name of cases[{seen[c.name]}]")
        seen[c.name] = i
        c.artifact = producers.setdefault(produce_key(c), c.name)
    return cases


def produce_key(c: Case) -> str:
    """What makes an artifact: model, verb, flags and recipe; equal keys share one artifact folder."""
    return json.dumps([c.model, c.produce.verb, c.produce.args, c.produce.recipe], sort_keys=True)


def select(cases: list[Case], only: list[str], skip: list[str]) -> list[Case]:
    """Cases named or tagged in ``only`` (default: all but those tagged optional), minus those in ``skip``."""
    known = {c.name for c in cases} | {t for c in cases for t in c.tags}
    for word in only + skip:
        if word not in known:
            raise CaseError(f"--only/--skip {word!r}: no case has that name or tag (names and tags: "
                            f"{', '.join(sorted(known))})")
    if only:
        picked = [c for c in cases if c.name in only or set(c.tags) & set(only)]
    else:
        picked = [c for c in cases if "optional" not in c.tags]
    return [c for c in picked if c.name not in skip and not set(c.tags) & set(skip)]


# ------------------------------------------------------------------------------------------------------------------
# The commands a case runs (shared by --dry-run and the run)


@dataclass
class Paths:
    """Where everything of a run lives, and the environments of the three Pythons."""

    out: Path
    arts: Path
    models: Path
    python: str
    quantkit_site: str
    vllm_site: str
    trt_site: str

    def model(self, c: Case) -> Path:
        return self.models / f"src-{c.model[6:]}" if c.model.startswith("shape:") else (REPO / c.model).resolve()

    def artifact(self, c: Case) -> Path:
        return self.arts / c.artifact

    def served(self, c: Case) -> Path:
        art = self.artifact(c)
        return art / c.produce.serve if c.produce.serve else art

    def logs(self, c: Case) -> Path:
        return self.out / "logs" / c.name

    def quantkit_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{REPO}:{self.quantkit_site}", "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}

    def vllm_env(self) -> dict[str, str]:
        return {"PYTHONPATH": self.vllm_site, "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1"}  # the GPU machine has no network

    def wrapper(self, name: str) -> Path:
        """A Python that sets its own environment, for the quantkit flags that take an interpreter path."""
        return self.out / "bin" / name

    def write_wrappers(self) -> None:
        envs = {"vllm-python": self.vllm_env(), "trt-python": {"PYTHONPATH": self.trt_site}}
        for name, env in envs.items():
            path = self.wrapper(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            path.write_text(f"#!/bin/sh\nexport {exports}\nexec {shlex.quote(self.python)} \"$@\"\n")
            path.chmod(0o755)


def recipe_text(c: Case, p: Paths) -> str:
    """The build-trt recipe with its model and output set to this run's."""
    r = c.produce.recipe
    data = yaml.safe_load((REPO / r).read_text()) if isinstance(r, str) else json.loads(json.dumps(r))
    data.setdefault("model", {})["source"] = str(p.model(c))
    data["output"] = str(p.artifact(c))
    return yaml.safe_dump(data, sort_keys=False)


def produce_argv(c: Case, p: Paths) -> list[str]:
    qk = [p.python, "-m", "quantkit"]
    if c.produce.verb == "build-trt":
        return qk + ["build-trt", str(p.out / "recipes" / f"{c.artifact}.yaml"), "--force", "--json",
                     "--python", str(p.wrapper("trt-python")), *c.produce.args]
    return qk + [c.produce.verb, str(p.model(c)), str(p.artifact(c)), "--force", "--json", *c.produce.args]


def shape_argv(c: Case, p: Paths) -> list[str]:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "from quantize_cost import make_checkpoint; make_checkpoint(sys.argv[1], Path(sys.argv[2]))")
    return [p.python, "-c", code, c.model[6:], str(p.model(c)), str(REPO / "bench")]


def share(c: Case, opts: argparse.Namespace) -> float:
    return c.gpu_memory_utilization or opts.mem_share


def kv_bytes(c: Case, opts: argparse.Namespace, timed: bool = False) -> int | None:
    """A fixed KV cache for vLLM starts that share the GPU; None for an exclusive case's load or sweep."""
    if (timed and c.exclusive) or opts.parallel == 1:
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
    return [p.python, "-m", "quantkit", "smoke", str(p.served(c)), "--engine", "vllm", "--python",
            str(p.wrapper("vllm-python")), "--json", "--log-dir", str(p.logs(c) / "smoke"), "--timeout",
            str(int(timeout)), "--gpu-memory-utilization", f"{share(c, opts):.2f}",
            *([f"--server-arg=--kv-cache-memory-bytes={kv}"] if kv else []), *c.smoke.args]


def eval_argv(c: Case, p: Paths) -> list[str]:
    assert c.eval is not None
    return [p.python, "-m", "quantkit", "eval", str(p.served(c)), "--engine", "vllm", "--python",
            str(p.wrapper("vllm-python")), "--baseline", str(p.model(c)), "--dataset", c.eval.dataset, "--ctx",
            str(c.eval.ctx), "--max-tokens", str(c.eval.max_tokens), "--report-dir", str(p.logs(c) / "eval"),
            "--json"]


def eval_env(c: Case, p: Paths, opts: argparse.Namespace) -> dict[str, str]:
    args = {"gpu_memory_utilization": share(c, opts), **c.load.engine_args}
    if kv := kv_bytes(c, opts):
        args["kv_cache_memory_bytes"] = kv
    return {**p.quantkit_env(), "QUANTKIT_VLLM_ARGS": json.dumps(args)}


def missing_needs(c: Case, p: Paths) -> str | None:
    """Why the case cannot run on this machine (an environment it needs is absent), or None."""
    if "trt" in c.needs and not (Path(p.trt_site) / "modelopt").is_dir():
        return f"the ModelOpt environment is not installed in {p.trt_site} (scripts/trt_env.sh)"
    return None


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


def describe_expect(e: Expect) -> str:
    parts = [f"loads={'yes' if e.loads else 'no'}"]
    parts += [f"quantization={e.quantization}"] if e.quantization else []
    parts += [f"kernel~{e.kernel!r}"] if e.kernel else []
    parts += [f"moe~{e.moe_kernel!r}"] if e.moe_kernel else []
    parts += [f"tok/s b{b}>={v:g}" for b, v in e.min_tok_s.items()]
    parts += ["smoke passes"] if e.smoke else []
    parts += [f"KLD<={e.max_kld:g}"] if e.max_kld is not None else []
    parts += [f"ppl ratio<={e.max_ppl_ratio:g}"] if e.max_ppl_ratio is not None else []
    parts += [f"top-1>={e.min_top1:g}"] if e.min_top1 is not None else []
    return ", ".join(parts)


def plan(cases: list[Case], p: Paths, opts: argparse.Namespace) -> str:
    """What a run would do, command by command (--dry-run)."""
    sh = shlex.join
    out = [f"{len(cases)} cases, budget {opts.budget:.0f} s, {opts.parallel} at a time, vLLM memory share "
           f"{opts.mem_share:.2f} each, starts {opts.stagger:.0f} s apart; results in {p.out}",
           f"quantkit: PYTHONPATH={REPO}:{p.quantkit_site}; vLLM: PYTHONPATH={p.vllm_site}; "
           f"ModelOpt: PYTHONPATH={p.trt_site}", ""]
    for c in cases:
        out.append(f"== {c.name} [{', '.join(c.tags)}] estimate {c.estimate_s:.0f} s"
                   + (", exclusive" if c.exclusive else ""))
        if reason := missing_needs(c, p):
            out.append(f"   skipped on this machine: {reason}")
        if c.model.startswith("shape:"):
            out.append(f"   model:   {sh(shape_argv(c, p))}  (reused when built)")
        state = "reuse" if reusable(c, p) and not opts.rebuild else "build"
        out.append(f"   produce ({state}): {sh(produce_argv(c, p))}")
        if c.produce.recipe is not None:
            out.append("            recipe: " + recipe_text(c, p).strip().replace("\n", "; "))
        b = bench_of(c.sweep or c.load, c, opts)
        engine_args = b.request(p.served(c), kernels.Configuration("default", "default", ()))["engine_args"]
        out.append(f"   {'sweep' if c.sweep else 'load'}:    {p.python} {kernel_sweep.CHILD.relative_to(REPO)} REQUEST "
                   f"(PYTHONPATH={p.vllm_site}); engine args {json.dumps(engine_args)}, batches {list(b.batches)}, "
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
            out.append(f"   eval:    QUANTKIT_VLLM_ARGS={shlex.quote(eval_env(c, p, opts)['QUANTKIT_VLLM_ARGS'])} "
                       f"{sh(eval_argv(c, p))}")
        out.append(f"   expect:  {describe_expect(c.expect)}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------------------------
# Checks and the table (pure: outcome dict in, results out)


def matches(pattern: str, lines: list[str]) -> bool:
    """A substring of one of the lines, or /regex/ searched in each."""
    if len(pattern) > 1 and pattern.startswith("/") and pattern.endswith("/"):
        rx = re.compile(pattern[1:-1])
        return any(rx.search(line) for line in lines)
    return any(pattern in line for line in lines)


def _check(name: str, expected: Any, actual: Any, ok: bool | None, note: str = "") -> dict[str, Any]:
    status = "skip" if ok is None else ("pass" if ok else "fail")
    return {"check": name, "expected": expected, "actual": actual, "status": status, "note": note}


def evaluate(c: Case, o: dict[str, Any]) -> list[dict[str, Any]]:
    """Every expectation of the case against what was measured; a measurement that is missing is a skip."""
    e, checks = c.expect, []
    load = o.get("load")
    ran = load is not None and load.get("status") not in (None, "not run")
    loaded = ran and load["status"] == "ok"
    facts = (load or {}).get("facts") or {}
    checks.append(_check("loads", e.loads, loaded if ran else None, (loaded == e.loads) if ran else None,
                         "" if loaded or not ran else (load.get("error") or "")[:200]))
    if e.quantization:
        got = facts.get("quantization") or ((load or {}).get("extra") or {}).get("quantization")
        checks.append(_check("quantization", e.quantization, got, (got == e.quantization) if loaded else None))
    linear = [f"{k} for {layer}" for layer, k in facts.get("linear") or []]
    if e.kernel:
        checks.append(_check("kernel", e.kernel, linear, matches(e.kernel, linear) if loaded else None))
    if e.moe_kernel:
        moe = list(facts.get("moe") or [])
        checks.append(_check("moe_kernel", e.moe_kernel, moe, matches(e.moe_kernel, moe) if loaded else None))
    for b, floor in e.min_tok_s.items():
        got = ((load or {}).get("decode_tok_s") or {}).get(str(b))
        checks.append(_check(f"tok/s b{b}", floor, got, (got >= floor) if got is not None else None))
    smoke = o.get("smoke")
    if e.smoke is not None:
        got = (smoke or {}).get("status")
        ok = None if got in (None, "not run") else (got == "passed") == e.smoke
        checks.append(_check("smoke", "passed" if e.smoke else "fails", got, ok, (smoke or {}).get("error") or ""))
    if smoke and smoke.get("doctor_ok") is not None and ran:
        checks.append(_check("doctor agrees", loaded, smoke["doctor_ok"], smoke["doctor_ok"] == loaded,
                             "; ".join(smoke.get("doctor") or [])[:300]))
    ev = o.get("eval") or {}
    for key, metric, upper in (("max_kld", "kld", True), ("max_ppl_ratio", "ppl_ratio", True),
                               ("min_top1", "top1", False)):
        limit = getattr(e, key)
        if limit is not None:
            got = ev.get(metric)
            checks.append(_check(metric, limit, got, None if got is None else (got <= limit if upper else
                                                                               got >= limit)))
    return checks


def verdict(o: dict[str, Any]) -> str:
    """pass, fail (a check failed) or error (a step could not produce what the checks need)."""
    if o.get("error"):
        return "error"
    if any(ch["status"] == "fail" for ch in o.get("checks") or []):
        return "fail"
    return "pass"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The run as a table: one row per case, then the failed checks and the kernel sweeps."""
    lines = ["# GPU end-to-end cases", "", f"- started {header.get('started')}, updated {header.get('updated')}",
             f"- machine: {', '.join(header.get('gpus') or ['no GPU seen'])}; vLLM {header.get('vllm') or '?'}", "",
             "| case | artifact | loads | vLLM quantization | kernel vLLM picked | tok/s b1 | tok/s b16 | smoke | "
             "KLD | ppl ratio | top-1 | checks | status |", "|" + "---|" * 13]
    for r in results:
        load, ev, smoke = r.get("load") or {}, r.get("eval") or {}, r.get("smoke") or {}
        facts = load.get("facts") or {}
        checks = r.get("checks") or []
        passed = sum(ch["status"] == "pass" for ch in checks)
        failed = [ch["check"] for ch in checks if ch["status"] == "fail"]
        tok = load.get("decode_tok_s") or {}
        cells = [r["name"], (r.get("artifact") or {}).get("status", "-"),
                 {"ok": "yes", None: "-", "not run": "-"}.get(load.get("status"), "NO"),
                 facts.get("quantization") or "-", "<br>".join(facts.get("kernels") or []) or "-",
                 _num(tok.get("1"), ".0f"), _num(tok.get("16"), ".0f"), smoke.get("status") or "-",
                 _num(ev.get("kld"), ".4f"), _num(ev.get("ppl_ratio"), ".4f"), _num(ev.get("top1"), ".3f"),
                 f"{passed}/{len(checks)}" + (f" (failed: {', '.join(failed)})" if failed else ""),
                 r.get("status", "-") + (f": {r['reason']}" if r.get("reason") else "")]
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    bad = [(r["name"], ch) for r in results for ch in r.get("checks") or [] if ch["status"] == "fail"]
    if bad:
        lines += ["", "## Failed checks", ""]
        lines += [f"- {n}: {ch['check']}: expected {ch['expected']!r}, got {ch['actual']!r}"
                  + (f" ({ch['note']})" if ch.get("note") else "") for n, ch in bad]
    errors = [(r["name"], r["error"]) for r in results if r.get("error")]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {n}: {e}" for n, e in errors]
    for r in results:
        sw = r.get("sweep")
        if sw:
            ms = [kernels.Measurement.from_json(m) for m in sw.get("measurements") or []]
            choice = sw.get("choice")
            ch = kernels.Choice(kernels.Configuration.from_json(choice["configuration"]), choice["reason"],
                                choice["measured"]) if choice else None
            lines += ["", f"## Kernel sweep: {r['name']}", "",
                      kernels.markdown(ms, ch, tuple(sw["bench"]["batches"])).rstrip()]
            if sw.get("command"):
                lines += ["", f"Serve with: `{sw['command']['shell']}`"]
    return "\n".join(lines) + "\n"


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
    """Runs the selected cases within the budget, several at once, writing results after every step."""

    def __init__(self, cases: list[Case], p: Paths, opts: argparse.Namespace, previous: dict[str, dict]) -> None:
        self.cases, self.p, self.opts = cases, p, opts
        self.t0 = time.monotonic()
        self.deadline = self.t0 + opts.budget
        self.gate = GpuGate(opts.stagger)
        self.lock = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}
        self.stop = threading.Event()  # SIGTERM/SIGINT: start nothing more
        self.header: dict[str, Any] = {"started": _now(), "budget_s": opts.budget, "gpus": gpus(),
                                       "command": shlex.join([Path(sys.executable).name, *sys.argv])}
        self.rebuilt: set[str] = set()  # artifacts this run produced (--rebuild redoes each once)
        self.results: dict[str, dict[str, Any]] = {}  # published snapshots; each case thread owns its own dict
        for c in cases:
            old = previous.get(c.name)
            self.results[c.name] = old if old and old.get("status") in FINISHED else \
                {"name": c.name, "tags": c.tags, "status": "pending"}

    def left(self) -> float:
        return self.deadline - time.monotonic()

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
            elif self.left() < c.estimate_s:
                o.update(status="not run",
                         reason=f"{self.left():.0f} s of the budget left, estimate {c.estimate_s:.0f} s")
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
        if c.model.startswith("shape:"):
            with self.once(f"model:{c.model}"), self.gate.use():
                if self.process(c, "model", shape_argv(c, p), p.quantkit_env(), logs / "model.log", 900):
                    raise StepFailed(f"model: building {c.model} failed: {_tail(logs / 'model.log')}")
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
        self.publish(c.name, o)
        if c.smoke and not self.opts.no_smoke:
            with self.gate.use():
                o["smoke"] = self.smoke(c, logs)
            self.publish(c.name, o)
        if c.eval and not self.opts.no_eval:
            with self.gate.use():
                o["eval"] = self.evaluate_step(c, logs)

    @contextmanager
    def once(self, key: str) -> Iterator[None]:
        """One thread at a time per shared thing (a model shape, an artifact two cases share)."""
        with self.lock:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            yield

    def timeout(self, step: str, limit: float) -> float:
        """The time a step may take, or StepFailed when it must not start (budget spent, run stopped)."""
        if self.stop.is_set():
            raise StepFailed(f"{step}: not run, the run was stopped")
        left = self.left() - 5
        if left < 20:
            raise StepFailed(f"{step}: not run, {max(0.0, self.left()):.0f} s of the budget left")
        return min(limit, left)

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
        rc = self.process(c, "produce", produce_argv(c, p), p.quantkit_env(), log, 1200, logs / "produce.json",
                          cwd=p.arts)
        self.rebuilt.add(c.artifact)
        if rc != 0 or not (p.served(c) / "config.json").is_file():
            raise StepFailed(f"produce: quantkit {c.produce.verb} exited {rc}: {_tail(log)}")
        (p.arts / f"{c.artifact}.stamp.json").write_text(json.dumps(stamp(c, p), indent=2))
        return {**art, "status": "built", "seconds": round(time.monotonic() - t, 1), "log": str(log)}

    def runtime(self) -> kernel_sweep.Runtime:
        return kernel_sweep.Runtime(self.p.python, self.p.vllm_env())

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
                               force=c.sweep.force, timeout=c.sweep.timeout, deadline=self.deadline - 5,
                               only=c.sweep.only or None, on_update=update, stop=self.stop)
        return r.to_json()

    def smoke(self, c: Case, logs: Path) -> dict[str, Any]:
        assert c.smoke is not None
        timeout = self.timeout("smoke", c.smoke.timeout + 120)
        self.gate.engine_start()
        out = logs / "smoke.json"
        rc = self.process(c, "smoke", smoke_argv(c, self.p, self.opts, max(60.0, min(c.smoke.timeout, timeout - 60))),
                          self.p.quantkit_env(), logs / "smoke.stderr.log", timeout, out)
        return smoke_summary(_json(out), rc, logs / "smoke.stderr.log")

    def evaluate_step(self, c: Case, logs: Path) -> dict[str, Any]:
        assert c.eval is not None
        self.gate.engine_start()
        out = logs / "eval.json"
        rc = self.process(c, "eval", eval_argv(c, self.p), eval_env(c, self.p, self.opts), logs / "eval.stderr.log",
                          c.eval.timeout, out)
        return eval_summary(_json(out), rc, logs / "eval.stderr.log")


class StepFailed(Exception):
    """A step that could not give the checks what they need (the message says which and why)."""


def run_split(argv: list[str], env: dict[str, str], log: Path, timeout: float, stdout: Path | None,
              cwd: Path | None) -> tuple[int | None, float]:
    """kernel_sweep.run_logged, with stdout kept apart (a --json document) when ``stdout`` is given."""
    if stdout is None:
        return kernel_sweep.run_logged(argv, env, log, timeout, cwd)
    wrapped = ["sh", "-c", 'exec "$@" 2>"$0"', str(log), *argv]
    return kernel_sweep.run_logged(wrapped, env, stdout, timeout, cwd)


def smoke_summary(data: Any, rc: int, log: Path) -> dict[str, Any]:
    """What the checks need from ``quantkit smoke --json``."""
    if not isinstance(data, dict):
        return {"status": "failed", "error": f"quantkit smoke exited {rc} without JSON: {_tail(log)}"}
    run = (data.get("runs") or [{}])[0]
    doctor = data.get("doctor") or {}
    facts = run.get("facts") or {}
    return {"status": run.get("status"), "ttft_s": run.get("ttft_s"), "decode_tok_s": run.get("decode_tokens_per_s"),
            "healthy_after_s": run.get("healthy_after_s"), "kernels": facts.get("kernels"),
            "quantization": facts.get("quantization"), "doctor_ok": doctor.get("ok"),
            "doctor": [f"{ch['status']}: {ch['name']}: {ch['message']}" for ch in doctor.get("checks") or []
                       if ch.get("status") != "ok"],
            "completion": (run.get("completion") or {}).get("text"), "error": run.get("error"), "log": run.get("log")}


def eval_summary(data: Any, rc: int, log: Path) -> dict[str, Any]:
    """What the checks need from ``quantkit eval --json`` (exit 3, a gate, still wrote the report)."""
    if not isinstance(data, dict) or not data.get("results"):
        return {"error": f"quantkit eval exited {rc} without results: {_tail(log)}"}
    r = data["results"][0]
    return {"kld": r.get("kld"), "ppl_ratio": r.get("ppl_ratio"), "top1": r.get("top1"), "ppl": r.get("ppl"),
            "baseline_ppl": (data.get("baseline") or {}).get("ppl"), "tokens": r.get("tokens"),
            "engine": r.get("engine"), "exit": rc}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _tail(log: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " / ".join(lines[-n:])[-400:]


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return [x.strip() for x in out.stdout.splitlines() if x.strip()]


# ------------------------------------------------------------------------------------------------------------------
# Entry points


def preflight(p: Paths) -> None:
    """Fail in seconds when quantkit or vLLM cannot even be found."""
    qk = subprocess.run([p.python, "-c", "import quantkit.cli.main"], env=p.quantkit_env(), capture_output=True,
                        text=True)
    if qk.returncode:
        raise CaseError(f"quantkit does not import with {p.python} and PYTHONPATH={REPO}:{p.quantkit_site}: "
                        f"{(qk.stderr.strip().splitlines() or ['?'])[-1]}")
    if not (Path(p.vllm_site) / "vllm").is_dir() and subprocess.run(
            [p.python, "-c", "import vllm"], env={**os.environ, **p.vllm_env()}, capture_output=True).returncode:
        raise CaseError(f"vLLM is not installed in {p.vllm_site} (../shared/device/vllm/README.md)")


def running_pid(out: Path) -> int | None:
    """The pid of a runner still alive that writes into ``out``, if any."""
    try:
        pid = int((out / "runner.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and b"gpu_cases.py" in cmdline else None


def status(out: Path) -> str:
    """The progress log's end and the table so far (for polling a background run)."""
    parts = []
    done = out / "DONE"
    parts.append(f"finished: {done.read_text().strip()}" if done.exists() else "running (no DONE file yet)")
    log = out / "progress.log"
    if log.exists():
        parts += ["", *log.read_text().splitlines()[-15:]]
    md = out / "results.md"
    parts += ["", md.read_text() if md.exists() else "no results yet"]
    return "\n".join(parts)


def collect(out: Path, dest: Path, limit: int = 15 * 2**20) -> list[Path]:
    """Copy results.json, results.md, progress.log and one logs.tar.gz (each log cut to its last 256 KiB, the
    whole under ``limit``) into ``dest``: few files, flat, as a device call's $OUT takes them."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in ("results.json", "results.md", "progress.log", "DONE"):
        if (out / name).exists():
            shutil.copy(out / name, dest / name)
            copied.append(dest / name)
    logs = sorted((out / "logs").rglob("*")) if (out / "logs").exists() else []
    tar_path = dest / "logs.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for f in logs:
            if not f.is_file() or f.suffix == ".png":
                continue
            data = f.read_bytes()[-256 * 2**10:]
            info = tarfile.TarInfo(str(f.relative_to(out)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            if tar_path.stat().st_size > limit:
                break
    copied.append(tar_path)
    return copied


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=Path, default=CASES, help="the case file [default: scripts/gpu_cases.yaml]")
    ap.add_argument("--out", type=Path, default=Path("/tmp/qk-gpu"), help="results, logs, artifacts")
    ap.add_argument("--arts", type=Path, help="artifact folder [default: OUT/arts]")
    ap.add_argument("--only", action="append", default=[], help="case name or tag (repeatable, or comma-separated)")
    ap.add_argument("--skip", action="append", default=[], help="case name or tag to leave out")
    ap.add_argument("--budget", type=float, default=1500, help="seconds; no case starts past it")
    ap.add_argument("--parallel", type=int, default=4, help="cases at once on the GPU")
    ap.add_argument("--stagger", type=float, default=5, help="seconds between two vLLM starts")
    ap.add_argument("--mem-share", type=float, default=0.12, help="GPU memory fraction per vLLM instance")
    ap.add_argument("--kv-cache-gib", type=float, default=4, help="fixed KV cache of each vLLM sharing the GPU")
    ap.add_argument("--python", default="python3", help="the interpreter of all three environments")
    ap.add_argument("--quantkit-site", default="/tmp/site-llmc", help="PYTHONPATH added for quantkit")
    ap.add_argument("--vllm-site", default="/tmp/site", help="PYTHONPATH of vLLM's environment")
    ap.add_argument("--trt-site", default="/tmp/site-trt", help="PYTHONPATH of ModelOpt's environment")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/quantkit-bench-qcost"),
                    help="where shape:NAME models are built (src-NAME; shared with bench/quantize_cost.py)")
    ap.add_argument("--rebuild", action="store_true", help="produce every artifact again")
    ap.add_argument("--resume", action="store_true", help="keep finished cases of OUT/results.json")
    ap.add_argument("--no-smoke", action="store_true")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="plain loads instead of kernel sweeps")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    ap.add_argument("--status", action="store_true", help="print the progress of a run in OUT and exit")
    ap.add_argument("--wait", type=float, metavar="SECONDS", help="wait until the run in OUT ends (at most "
                    "SECONDS), then print its status")
    ap.add_argument("--collect", type=Path, metavar="DEST", help="copy OUT's results and logs into DEST and exit")
    args = ap.parse_args(argv)
    args.only = [w for x in args.only for w in x.split(",") if w]
    args.skip = [w for x in args.skip for w in x.split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    out = opts.out.resolve()
    if opts.status or opts.wait or opts.collect:
        if opts.wait:
            end = time.monotonic() + opts.wait
            while running_pid(out) is not None and time.monotonic() < end:
                time.sleep(5)
        if opts.status or opts.wait:
            print(status(out))
        if opts.collect:
            for f in collect(out, opts.collect):
                print(f)
        return 0
    p = Paths(out, (opts.arts or out / "arts").resolve(), opts.models_dir.resolve(), opts.python, opts.quantkit_site,
              opts.vllm_site, opts.trt_site)
    try:
        cases = select(load_cases(opts.cases), opts.only, opts.skip)
        if opts.dry_run:
            print(plan(cases, p, opts), end="")
            return 0
        if (other := running_pid(out)) is not None:
            raise CaseError(f"a run (pid {other}) is still writing into {out}; poll it with --status")
        preflight(p)
    except CaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "DONE").unlink(missing_ok=True)
    if not opts.resume:
        (out / "progress.log").unlink(missing_ok=True)
    (out / "runner.pid").write_text(str(os.getpid()))
    p.write_wrappers()
    previous = {}
    if opts.resume and (old := _json(out / "results.json")):
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
    run.log(f"{len(cases)} cases, budget {opts.budget:.0f} s, {opts.parallel} at a time")
    run.run()
    results = [run.results[c.name] for c in cases]
    summary = {s: sum(r["status"] == s for r in results) for s in dict.fromkeys(r["status"] for r in results)}
    (out / "DONE").write_text(json.dumps(summary) + "\n")
    run.log(f"done: {summary}")
    print((out / "results.md").read_text())
    if run.stop.is_set():
        return 130
    return 0 if all(r["status"] in ("pass", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
