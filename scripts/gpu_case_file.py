"""The GPU case file (scripts/gpu_cases.yaml): its schema, its validation with file and line in every message,
and the selection of cases (--only, --skip). Pure: reading and checking only; scripts/gpu_cases.py runs them."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))
from shapes import SHAPES  # noqa: E402

from quantkit import formats  # noqa: E402
from quantkit.formats.names import TRANSFORMERS, VLLM  # noqa: E402

CASES = Path(__file__).with_name("gpu_cases.yaml")
ARCHITECTURES = REPO / "tests" / "data" / "architectures.yaml"  # the families arch:FAMILY names
ARCH_FAMILIES = tuple((yaml.safe_load(ARCHITECTURES.read_text()) or {}).get("families") or ())
# The tiny vision-language families vlm:FAMILY names (tests/vlm_models.py, read without importing torch).
VLM_FAMILIES = tuple(__import__("ast").literal_eval(next(
    line.split("=", 1)[1].strip() for line in (REPO / "tests" / "vlm_models.py").read_text().splitlines()
    if line.startswith("FAMILIES = "))))
# A produce step's quantkit VERB: the formats table's, and run (quantkit run on the case's recipe, whose own
# evaluation and smoke test must have run and passed).
VERBS = (*(f.verb for f in formats.FORMATS if f.verb), "run")
RECIPE_VERBS = ("build-trt", "run")  # the verbs that read a recipe (and need one)
NEEDS = ("trt", "gpus2")  # the ModelOpt environment; two visible GPUs
ENGINES = (VLLM, TRANSFORMERS)  # quantkit eval --engine, on the GPU
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class CaseError(Exception):
    """A case file that cannot be run: one line saying where and what."""


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
    """quantkit eval against the source model, once per engine (vLLM's figures are the case's KLD, ppl ratio and
    top-1; a transformers run beside it says whether the two engines agree)."""

    max_tokens: int = 32768
    ctx: int = 2048
    dataset: str = "heldout"
    timeout: float = 420
    engines: list[str] = field(default_factory=lambda: ["vllm"])


@dataclass
class Expect:
    loads: bool = True
    quantization: str | None = None
    kernel: str | None = None
    moe_kernel: str | None = None
    moe_method: str | None = None
    min_tok_s: dict[int, float] = field(default_factory=dict)
    smoke: bool | None = None
    max_kld: float | None = None
    max_ppl_ratio: float | None = None
    min_top1: float | None = None
    max_engine_ppl_diff: float | None = None


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
    pending: str | None = None  # why its model may not exist yet (the file's pending_models entry)


SWEEP_DEFAULTS = {"prompt_len": 512, "gen": 128, "max_model_len": 2048, "enforce_eager": False, "timeout": 600}


SECTIONS: dict[str, tuple[type, dict[str, Any]]] = {
    "produce": (Produce, {"verb": VERBS, "args": "strs", "recipe": "recipe", "serve": "str"}),
    "load": (Measure, {"batches": "ints", "prompt_len": "int", "gen": "int", "max_model_len": "int",
                       "enforce_eager": "bool", "engine_args": "map", "timeout": "num"}),
    "sweep": (Measure, {"batches": "ints", "prompt_len": "int", "gen": "int", "max_model_len": "int",
                        "enforce_eager": "bool", "engine_args": "map", "timeout": "num", "force": ("env", "backend"),
                        "only": "strs"}),
    "smoke": (Smoke, {"args": "strs", "timeout": "num"}),
    "eval": (Eval, {"max_tokens": "int", "ctx": "int", "dataset": "str", "timeout": "num", "engines": "engines"}),
    "expect": (Expect, {"loads": "bool", "quantization": "str", "kernel": "pattern", "moe_kernel": "pattern",
                        "moe_method": "pattern", "min_tok_s": "tokmap", "smoke": "bool", "max_kld": "num",
                        "max_ppl_ratio": "num", "min_top1": "num", "max_engine_ppl_diff": "num"}),
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
              "recipe": isinstance(v, (str, dict)), "pattern": isinstance(v, str),
              "engines": isinstance(v, list) and bool(v) and all(x in ENGINES for x in v) and len(set(v)) == len(v)
              }[kind]
        if not ok:
            want = {"strs": "a list of strings", "ints": "a non-empty list of positive integers", "map": "a mapping",
                    "engines": f"a list of distinct engines from {', '.join(ENGINES)}",
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

    def case(self, i: int, raw: Any, defaults: dict[str, Any], pending: dict[str, str]) -> Case:
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
        case.pending = pending.get(case.model)
        self.check(where, case, raw)
        return case

    def check(self, where: tuple, c: Case, raw: dict[str, Any]) -> None:
        """Rules across fields."""
        if not NAME.match(c.name):
            self.fail(where + ("name",), f"use letters, digits, '.', '_' and '-' only; got {c.name!r}")
        if c.produce.verb in RECIPE_VERBS and c.produce.recipe is None:
            self.fail(where + ("produce",), f"{c.produce.verb} needs a recipe (file or mapping)")
        if c.produce.recipe is not None and c.produce.verb not in RECIPE_VERBS:
            self.fail(where + ("produce", "recipe"), "only build-trt takes a recipe (and run); give other verbs args")
        if isinstance(c.produce.recipe, str) and not (REPO / c.produce.recipe).is_file():
            self.fail(where + ("produce", "recipe"), f"no recipe file {c.produce.recipe} in the repository")
        if c.model.startswith("shape:"):
            if c.model[6:] not in SHAPES:
                self.fail(where + ("model",), f"unknown shape {c.model[6:]!r}; bench/shapes.py has "
                          + ", ".join(SHAPES))
        elif c.model.startswith("arch:"):
            if c.model[5:] not in ARCH_FAMILIES:
                self.fail(where + ("model",), f"unknown family {c.model[5:]!r}; {ARCHITECTURES.relative_to(REPO)} "
                          "has " + ", ".join(ARCH_FAMILIES))
        elif c.model.startswith("vlm:"):
            if c.model[4:] not in VLM_FAMILIES:
                self.fail(where + ("model",), f"unknown vision-language family {c.model[4:]!r}; tests/vlm_models.py "
                          "has " + ", ".join(VLM_FAMILIES))
        elif not (REPO / c.model / "config.json").is_file() and c.pending is None:
            self.fail(where + ("model",), f"no checkpoint (config.json) at {c.model} (a model still to come goes "
                      "under pending_models)")
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
            if getattr(e, key) is not None and (c.eval is None or "vllm" not in c.eval.engines):
                self.fail(where + ("expect", key), "needs an eval: section with the vllm engine")
        if e.max_engine_ppl_diff is not None and (c.eval is None or set(c.eval.engines) != set(ENGINES)):
            self.fail(where + ("expect", "max_engine_ppl_diff"), "needs eval: {engines: [vllm, transformers]}")
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
        if key not in ("defaults", "cases", "pending_models"):
            reader.fail((key,), "unknown key; expected defaults, pending_models or cases")
    pending = data.get("pending_models") or {}
    if not isinstance(pending, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                and not k.startswith(("shape:", "arch:", "vlm:"))
                                                for k, v in pending.items()):
        reader.fail(("pending_models",), "expected a mapping of model folder to why it is not there yet")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict) or "name" in defaults:
        reader.fail(("defaults",), "expected a mapping of case keys (without name)")
    for key in defaults:
        if key not in TOP:
            reader.fail(("defaults", key), f"unknown key; expected one of {', '.join(TOP)}")
    cases = [reader.case(i, raw, defaults, pending) for i, raw in enumerate(data["cases"])]
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


def describe_expect(e: Expect) -> str:
    parts = [f"loads={'yes' if e.loads else 'no'}"]
    parts += [f"quantization={e.quantization}"] if e.quantization else []
    parts += [f"kernel~{e.kernel!r}"] if e.kernel else []
    parts += [f"moe~{e.moe_kernel!r}"] if e.moe_kernel else []
    parts += [f"moe method~{e.moe_method!r}"] if e.moe_method else []
    parts += [f"tok/s b{b}>={v:g}" for b, v in e.min_tok_s.items()]
    parts += ["smoke passes"] if e.smoke else []
    parts += [f"KLD<={e.max_kld:g}"] if e.max_kld is not None else []
    parts += [f"ppl ratio<={e.max_ppl_ratio:g}"] if e.max_ppl_ratio is not None else []
    parts += [f"top-1>={e.min_top1:g}"] if e.min_top1 is not None else []
    parts += [f"|ppl vLLM/transformers - 1|<={e.max_engine_ppl_diff:g}"] if e.max_engine_ppl_diff is not None else []
    return ", ".join(parts)
