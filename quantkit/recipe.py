"""The recipe: one YAML schema (pydantic models) for every format quantkit writes.

A recipe is data, like an llm-compressor recipe: which source model, which outputs (method + parameters), which
calibration data, which verification gates. The CLI verbs build the same object from flags, so a recipe file
and a command line are two spellings of one thing, and flags override recipe fields.

Validation happens before any model loads. A bad recipe raises :class:`RecipeError` naming the field, the
YAML line it came from and what was expected. YAML is read with the safe loader only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from quantkit import formats, seal
from quantkit.errors import RecipeError
from quantkit.formats.names import EVALUATING, FIELD_FILES_SHOWN, SERVING, TEXT_FILES_SHOWN
from quantkit.formats.specs import NAMES_ITS_INPUT, MethodBase, Strict
from quantkit.manifest import open_regular
from quantkit.outputs import RELEASE_NAMES


PATH_LENGTH = 4096  # Linux's PATH_MAX
NAME_LENGTH = 255  # bytes of one file name (Linux's NAME_MAX)


class ModelSpec(Strict):
    """The source checkpoint: a local folder or a Hugging Face hub id (optionally pinned to a revision)."""

    source: str = Field(max_length=PATH_LENGTH, description="local folder or hub id (org/name)")
    revision: str | None = Field(None, max_length=256, description="hub branch, tag or commit; recorded in the "
                                 "manifest")
    base_model: str | None = Field(None, max_length=NAME_LENGTH, description="the hub id (org/name) a local "
                                   "source was downloaded from, named as the model cards' base_model; a hub source "
                                   "names itself")
    trust_remote_code: bool = Field(False, description="run the checkpoint's own Python code (off by default)")
    allow_pickle: bool = Field(False, description="accept .bin/.pt pickle weights (unsafe; off by default)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


    @field_validator("base_model")
    @classmethod
    def _hub_id(cls, v: str | None) -> str | None:
        """The hub links a card's ``base_model`` only when it is a repository id that exists: a path or a bare name
        would publish a card whose link goes nowhere."""
        if v is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(v)
            except HFValidationError as e:
                raise ValueError(f"{v!r} is not a hub id: {' '.join(str(e).split())}") from None
            if v.count("/") != 1:
                raise ValueError(f"{v!r} is not a hub id: give ORG/NAME, as on the model's hub page")
        return v


class CalibrationSpec(Strict):
    """Where calibration text comes from and how much of it to use."""

    dataset: str = Field("mixed", description=f"shipped set (prose, code, mixed, heldout), a {TEXT_FILES_SHOWN} "
                         "file, or a hub name")
    samples: int = Field(128, ge=1, le=65536)
    seq_len: int = Field(512, ge=16, le=131072)
    seed: int = Field(0, ge=0, lt=2**64, description="order in which documents are drawn; in a recipe it follows "
                      "runtime.seed (--seed) unless set here")
    field: str = Field("text", description="JSON/parquet field holding the text")
    chat_template: bool | Literal["auto"] = Field("auto", description="render each sample with the model's "
                                                  "chat template; auto = for an instruct model (its EOS ends the "
                                                  "template's turns), not under images: GPTQ of "
                                                  "SmolLM2-135M-Instruct calibrated on packed plain text answers "
                                                  "in French (docs/calibration.md)")
    min_expert_tokens: int = Field(16, ge=0, description="warn when the router sends an MoE expert fewer "
                                   "calibration tokens than this")
    images: str | None = Field(None, max_length=PATH_LENGTH, description="vision-language models: calibrate on "
                               "image+text samples, each text sample after an image and its question: 'shipped' "
                               "(calibration/images) or a folder of images; unset = text only")


class GateSpec(Strict):
    """Release gates. A gate left out keeps its default, as a flag left out does (``eval --max-kld 0.1`` still gates
    perplexity and top-1): writing the one limit that matters must not quietly drop the others. ``null`` turns a
    gate off."""

    max_ppl_ratio: float | None = Field(1.5, gt=1.0, le=1e6, description="artifact ppl / baseline ppl; null: off")
    max_kld: float | None = Field(0.5, ge=0.0, le=1e6, description="mean KL(baseline || artifact), nats per token; "
                                  "null: off")
    min_top1: float | None = Field(0.6, ge=0.0, le=1.0, description="share of tokens whose argmax agrees; null: off")


class TaskSpec(Strict):
    """One lm-eval task scored on the baseline and each artifact (``quantkit eval --tasks``; quantkit/tasks/)."""

    task: str = Field(max_length=PATH_LENGTH, description="a shipped task (quantkit_lastword, quantkit_nextsentence, "
                      "quantkit_lastword_gen), a task name lm-eval knows, or a path to a task YAML in lm-eval's format")
    num_fewshot: int | None = Field(None, ge=0, le=1024, description="few-shot examples per prompt (the task's own "
                                    "default when unset)")
    limit: int | None = Field(None, ge=1, le=10**9, description="score only the first N items of the task")
    min_recovery: float | dict[str, float] | None = Field(
        None, description="fail when artifact / baseline (baseline / artifact for a lower-is-better metric) is "
        "below this, for every metric of the task (a number) or per metric ({acc_norm: 0.95})")

    @model_validator(mode="after")
    def _recoveries_in_range(self) -> "TaskSpec":
        limits = self.min_recovery.values() if isinstance(self.min_recovery, dict) else [self.min_recovery]
        for x in limits:
            if x is not None and not (0.0 < x <= 10.0 and math.isfinite(x)):
                raise ValueError(f"min_recovery {x} is not a ratio in (0, 10]")
        return self


# Seconds a starting server may make no progress before it is stopped: the schema's default, which
# quantkit.engines.watch applies to every wait on a child. The longest silence measured in a healthy start is 28 s
# (vLLM 0.26.0 on the 135M model); a large checkpoint's load logs progress as it goes.
DEFAULT_STALL_TIMEOUT = 180.0
# What "no progress" means there, said wherever the stall timeout is (quantkit.engines.watch watches each signal).
NO_PROGRESS = "no log output, no new process, no compiler running, no change of its GPU memory"


class EvaluationSpec(Strict):
    """The evaluation protocol and its gates (the recipe's ``evaluation:`` block; ``verify:`` in recipes written
    before it was renamed, still read)."""

    enabled: bool = True
    dataset: str = Field("auto", max_length=PATH_LENGTH, description="auto = WikiText-2 test when the hub is "
                         "reachable, else heldout")
    field: str = Field("text", max_length=256, description=f"JSON/parquet field holding the text (a "
                       f"{FIELD_FILES_SHOWN} file, an org/name hub dataset)")
    ctx: int = Field(2048, ge=16, le=1 << 20)
    stride: int | None = Field(None, ge=1, le=1 << 20)
    max_tokens: int | None = Field(None, ge=16, le=10**12, description="score at most this many tokens")
    engine: Literal[("auto", *EVALUATING)] = "auto"  # type: ignore[valid-type]
    stall_timeout: float = Field(DEFAULT_STALL_TIMEOUT, ge=0, le=7 * 86400, description="seconds an engine loading a "
                                 "model (vLLM's worker, an SGLang or task server) may make no progress before it is "
                                 "stopped; 0: never")
    gates: GateSpec = Field(default_factory=GateSpec)
    tasks: list[TaskSpec] = Field(default_factory=list, max_length=64, description="lm-eval tasks scored on the "
                                  "baseline and each artifact, with their recovery gates (quantkit eval --tasks)")


class SmokeSpec(Strict):
    """Serve the artifact in its real engine and ask it a few questions."""

    enabled: bool = True
    engine: Literal[("auto", *SERVING)] = "auto"  # type: ignore[valid-type]
    timeout: float = Field(600.0, gt=0, le=7 * 86400)
    stall_timeout: float = Field(DEFAULT_STALL_TIMEOUT, ge=0, le=7 * 86400, description="seconds a starting server "
                                 f"may make no progress ({NO_PROGRESS}) before it is stopped; 0: only the timeout")
    python: str | None = Field(None, max_length=PATH_LENGTH, description="the engine's own Python (vLLM/TensorRT-LLM "
                               "environments)")
    tp: int = Field(1, ge=1, le=1024, description="tensor-parallel size: GPUs each smoke server spans (vLLM, "
                    "TensorRT-LLM; GGUF outputs are served on one, llama.cpp spreads layers itself)")
    tune_kernels: bool = Field(False, description="also measure every vLLM kernel for each output served by vLLM "
                               "and record the fastest `vllm serve` command (quantkit tune; needs a GPU)")


MethodSpec = Annotated[Union[formats.specs()], Field(discriminator="method")]  # type: ignore[valid-type]
METHODS = formats.methods()


class RuntimeSpec(Strict):
    """Where and how the work runs. Not part of what an artifact *is*, but recorded for reproduction."""

    device: str = Field("auto", max_length=32, pattern=r"^(auto|cpu|cuda(:\d{1,4})?)$",
                        description="auto, cpu, cuda, cuda:N")
    num_gpus: int = Field(1, ge=1, le=1024, description="> 1 launches llm-compressor's distributed calibration")
    # Python's random.Random(-n) draws as Random(n): a negative seed would record another number than it draws with.
    seed: int = Field(0, ge=0, lt=2**64)
    python: str | None = Field(None, max_length=PATH_LENGTH, description="another Python environment for this step "
                               "(TensorRT-LLM)")


class Recipe(Strict):
    """A whole recipe. ``quantize`` (one artifact at ``output``) or ``outputs`` (several under ``output``)."""

    model: ModelSpec
    output: str = Field(max_length=PATH_LENGTH, description="artifact folder, or the release folder for several "
                        "outputs")
    quantize: MethodSpec | None = None
    outputs: list[MethodSpec] | None = None
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    smoke: SmokeSpec = Field(default_factory=SmokeSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    _path: Path | None = PrivateAttr(None)
    _where: str = PrivateAttr("recipe")  # the file, "+ command line" when flags set fields
    _lines: dict[tuple, int] = PrivateAttr(default_factory=dict)
    _flags: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def path(self) -> Path | None:
        """The recipe file it was read from (None when made from flags alone): an input no output may replace."""
        return self._path

    def problems(self, found: list[tuple[tuple, str]], hint: str | None = None) -> RecipeError:
        """Problems found after loading (lm-eval's tasks, built later: quantkit.api.recipe_tasks) as the schema's
        are reported: the file, each field with its line or flag."""
        return _refusal(self._where, [f"{_origin(loc, self._lines, self._flags)}: {why}" for loc, why in found],
                        hint)

    @model_validator(mode="after")
    def _one_seed(self) -> "Recipe":
        """``--seed`` (runtime.seed) also draws the calibration samples: one seed, as its help says. A recipe that
        sets calibration.seed itself keeps it."""
        if "seed" not in self.calibration.model_fields_set:
            self.calibration.seed = self.runtime.seed
        return self

    @field_validator("outputs")
    @classmethod
    def _some_outputs(cls, v: list[MethodSpec] | None) -> list[MethodSpec] | None:
        """A release of nothing would pass every gate and report ok: a recipe makes at least one artifact."""
        if v == []:
            raise ValueError("no outputs: a recipe makes at least one artifact (list one, or give 'quantize:')")
        return v

    @model_validator(mode="after")
    def _one_shape(self) -> "Recipe":
        if (self.quantize is None) == (self.outputs is None):
            raise ValueError("give exactly one of 'quantize' (one artifact) or 'outputs' (a list of artifacts)")
        return self

    def _folder_problems(self) -> list[tuple[tuple, str]]:
        """Output names that would put an artifact anywhere but its own folder of the release: (field path, why).

        A name is one plain folder name, so the artifact lands inside the release, where SHA256SUMS covers it, and
        apart from the names the release itself uses (:data:`quantkit.outputs.RELEASE_NAMES`). Folders are
        compared ignoring case: on a case-insensitive disk ``A`` and ``a`` are one folder.
        """
        found: list[tuple[tuple, str]] = []
        specs = [(("quantize",), self.quantize)] if self.quantize is not None else \
            [(("outputs", i), o) for i, o in enumerate(self.outputs or [])]
        for loc, spec in specs:
            why = None if spec.name is None else _not_a_folder_name(spec.name)
            if why:
                found.append((loc + ("name",), why))
        if self.outputs is not None:
            seen: dict[str, int] = {}
            for i, o in enumerate(self.outputs):
                name = formats.folder(o)
                first = seen.setdefault(name.casefold(), i)
                if first != i:
                    found.append((("outputs", i) + (("name",) if o.name is not None else ()),
                                  f"writes the same folder {name!r} as outputs.{first}; give each output a distinct "
                                  "'name'"))
        return found

    def artifacts(self) -> list[tuple[MethodSpec, Path]]:
        """Each output with the folder it is written to."""
        if self.quantize is not None:
            return [(self.quantize, Path(self.output))]
        return [(o, Path(self.output) / formats.folder(o)) for o in self.outputs or []]

    def output_sha256(self, spec: MethodBase) -> str:
        """Hash of what decides one output's bytes: the source, that output's spec, and the calibration data and
        seed only when the output reads calibration data.

        Adding an output to a recipe, changing its gates, or changing the calibration set of a recipe whose other
        outputs use none (RTN, FP8 dynamic, GGUF without an importance matrix) does not change those outputs'
        hashes, so a re-run reuses them.
        """
        relevant: dict[str, Any] = {"model": self.model.model_dump(mode="json"), "spec": spec.model_dump(mode="json")}
        given = Path(getattr(spec, "imatrix_file", None) or "").expanduser()
        if given.is_file():  # an importance matrix is an input by its bytes, not its path
            relevant["imatrix_sha256"] = seal.sha256_file(given)
        if formats.calibrates(spec):
            # the expert-token threshold only decides a warning, never the bytes
            relevant |= {"calibration": self.calibration.model_dump(mode="json", exclude={"min_expert_tokens"}),
                         "seed": self.runtime.seed}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()

    def sha256(self) -> str:
        """Hash of the recipe as run (canonical JSON), used to decide whether an artifact can be reused."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Loading with line numbers


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of YAML; the shipped ones are under 4 KiB
MAX_DEPTH = 32  # nesting of mappings and lists (the schema's deepest path is 4)
MAX_ALIASES = 64  # uses of an anchor (*name)
MAX_NODES = 100_000  # values in the document as it expands, every alias counted as the nodes it stands for
MAX_DIGITS = 40  # digits of a number (a seed is at most 20)
MAX_STRING = 4096  # characters of one string (a path, a pattern, a name)


class _Bound(yaml.composer.ComposerError):
    """A document past one of the loader's bounds (it may be valid YAML; it is no recipe)."""


class _LineLoader(yaml.SafeLoader):
    """The safe loader, bounded while it composes (depth, aliases, the expanded size: a "billion laughs" document
    is refused at its first line past the bound, before anything expands), with numbers of bounded length and
    dates kept as the strings they are. Every refusal is a YAML error with its line."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to

    def _refuse(self, problem: str, mark: Any) -> None:
        raise _Bound(None, None, problem, mark)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                self._refuse(f"more than {MAX_ALIASES} aliases (*name)", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            self._refuse(f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        children: list[Any] = []
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        size = 1 + sum(self._sizes.get(id(c), 1) for c in children)
        if size > MAX_NODES:
            self._refuse(f"expands to more than {MAX_NODES:,} values (aliases count as what they stand for)",
                         node.start_mark)
        self._sizes[id(node)] = size
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError, LookupError, AttributeError) as e:  # !!int x, an empty !!int
            raise yaml.constructor.ConstructorError(None, None, f"cannot read this value: {e}",
                                                    node.start_mark) from None

    def construct_yaml_int(self, node: Any) -> Any:
        if sum(c.isdigit() for c in str(node.value)) > MAX_DIGITS:
            raise _Bound(None, None, f"a number of more than {MAX_DIGITS} digits", node.start_mark)
        return super().construct_yaml_int(node)


_LineLoader.add_constructor("tag:yaml.org,2002:int", _LineLoader.construct_yaml_int)
_LineLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)
# YAML 1.1, which PyYAML reads, takes 1e-3 and 2.5e3 for strings (its floats need a dot and a signed exponent). The
# schema takes no number written as a string, so these are read as YAML 1.2 reads them: numbers.
_LineLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
                                  list("-+.0123456789"))


def _compose_lines(node: yaml.Node, path: tuple, lines: dict[tuple, int], twice: list[str]) -> None:
    """Record the line of each key path into ``lines``, and into ``twice`` each key a mapping sets again: YAML
    would keep the last value without a word, and which one was meant is not quantkit's to guess."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else "?"
            line = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode):
                first = seen.get((k.tag, k.value))
                if first is not None:
                    at = f"lines {first} and {line}" if first != line else f"line {line}"
                    twice.append(f"{_field(path + (key,))} ({at}): set twice; keep one")
                seen.setdefault((k.tag, k.value), line)
            lines[path + (key,)] = line
            _compose_lines(v, path + (key,), lines, twice)
            lines[path + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _compose_lines(item, path + (i,), lines, twice)


def _read_yaml(text: str, where: str) -> tuple[Any, dict[tuple, int], list[str]]:
    """The document, the line of each key path and the keys set twice, composed once under the loader's bounds."""
    loader = None
    try:
        loader = _LineLoader(text)  # its reader already refuses control characters
        node = loader.get_single_node()
        lines: dict[tuple, int] = {}
        twice: list[str] = []
        if node is not None:
            _compose_lines(node, (), lines, twice)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        what = "is refused" if isinstance(e, _Bound) else "is not valid YAML"
        raise RecipeError(f"{where}:{line} {what}: {getattr(e, 'problem', e)}") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines, twice


def _read_recipe_text(p: Path) -> str:
    """The recipe file's text, read bounded (a recipe is small; a huge file is refused before it is read); a FIFO or
    a device is refused, never waited on (:func:`quantkit.manifest.open_regular`)."""
    try:
        with open_regular(p, RecipeError) as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except FileNotFoundError:
        raise RecipeError(f"recipe {p} does not exist", hint="`quantkit recipes` lists the shipped ones") from None
    except OSError as e:
        raise RecipeError(f"cannot read recipe {p}: {e.strerror or e}") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{p}: the recipe is larger than {MAX_RECIPE_BYTES >> 10} KiB; a recipe is a page of YAML")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"cannot read recipe {p}: {e}") from None


def _out_of_bounds(data: Any, loc: tuple = ()) -> list[tuple[tuple, str]]:
    """Values no field takes, found before the schema looks (any field, the formats' specs included): strings
    longer than :data:`MAX_STRING`, numbers of more than :data:`MAX_DIGITS` digits, non-finite floats."""
    found: list[tuple[tuple, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            found += _out_of_bounds(v, loc + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found += _out_of_bounds(v, loc + (i,))
    elif isinstance(data, str) and len(data) > MAX_STRING:
        found.append((loc, f"a string of {len(data):,} characters; at most {MAX_STRING} are accepted"))
    elif isinstance(data, int) and not isinstance(data, bool) and abs(data) >= 10**MAX_DIGITS:
        found.append((loc, f"a number of more than {MAX_DIGITS} digits"))
    elif isinstance(data, float) and not math.isfinite(data):
        found.append((loc, f"{data} is not a finite number"))
    return found


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        if not isinstance(cur.get(k), dict):
            cur[k] = {}
        cur = cur[k]
    cur[keys[-1]] = value


def _field(loc: tuple) -> str:
    """A field's path as messages name it (``quantize.bits``, ``outputs.0.name``)."""
    # a key holding a newline or another unprintable character is shown escaped: the message stays one line
    return ".".join(repr(p) if isinstance(p, str) and not p.isprintable() else str(p) for p in loc) or "(top level)"


def _not_a_folder_name(name: str) -> str | None:
    """Why ``name`` is not one plain folder name an output may take inside a release, or None."""
    if name in (".", ".."):
        return f"{name!r} is no folder inside the release; give a folder name"
    if not name:
        return "an empty name; give a folder name, or leave 'name' out for the default"
    if "/" in name or "\\" in name:
        return f"{name!r} is a path; a name is one folder inside the release (no '/' or '\\')"
    if name.startswith("."):
        return f"{name!r} is hidden (it starts with '.'), and SHA256SUMS leaves hidden files out"
    if not name.isprintable():
        return f"{name!r} holds an unprintable character"
    if len(name.encode()) > NAME_LENGTH:
        return f"a name of {len(name.encode()):,} bytes; a folder name has at most {NAME_LENGTH}"
    reserved = {n.casefold(): n for n in RELEASE_NAMES}.get(name.casefold())
    if reserved:
        return f"the release itself uses {reserved!r}; an output's folder is none of {', '.join(RELEASE_NAMES)}"
    return None


def _describe(err: dict) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key (check the spelling; `quantkit recipes --schema` lists every field)"
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] in ("literal_error", "union_tag_invalid") or err["type"].endswith("_type"):
        return msg.replace("Input should be", "expected")
    return msg.removeprefix("Value error, ")


def validate(data: Any, *, where: str = "recipe", lines: dict[tuple, int] | None = None,
             flags: dict[str, str] | None = None, problems: list[str] | None = None,
             hint: str | None = None) -> Recipe:
    """Validate a recipe mapping; every problem is reported with its field path, line (or flag) and expectation,
    together with ``problems`` the caller found already (so one run shows them all).

    Values are taken as written (pydantic's strict mode, for every field at once): ``'512'`` or ``true`` where a
    number is expected is refused, not read as one, so what a recipe says is what runs; an integer serves where a
    float is expected."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping (key: value), not {type(data).__name__}")
    problems = list(problems or [])
    data = _renamed_keys(data, lines if lines is not None else {}, where)

    def origin(loc: tuple) -> str:
        return _origin(loc, lines or {}, flags or {})

    # Refused before the schema sees them, which would echo them back whole; the schema still checks every other
    # field (these set aside as None), so that one run lists all of a recipe's problems.
    huge = _out_of_bounds(data)
    problems += [f"{origin(loc)}: {why}" for loc, why in huge]
    set_aside = {loc for loc, _ in huge}
    try:
        recipe = Recipe.model_validate(_with_none_at(data, set_aside), strict=True)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if p not in METHODS)  # drop the discriminator's tag from the path
            if loc in set_aside or err["type"].startswith("union_tag") and any(a[:len(loc)] == loc for a in set_aside):
                continue  # said already: the value set aside (a method's among them, which picks the spec)
            got = err.get("input")
            quiet = ("missing", "extra_forbidden", NAMES_ITS_INPUT)
            got_s = "" if err["type"] in quiet or isinstance(got, dict) else f"; got {_short(got)}"
            problems.append(f"{origin(loc)}: {_describe(err)}{got_s}")
    else:
        problems += [f"{origin(loc)}: {why}" for loc, why in recipe._folder_problems()]
        if not problems:
            return recipe
    raise _refusal(where, problems, hint)


def _with_none_at(data: Any, locs: set[tuple]) -> Any:
    """``data`` with the value at each of ``locs`` (paths of keys and list indices) replaced by None; copied along
    those paths only, so the caller's mapping is left as it was."""
    if not locs:
        return data
    if () in locs:
        return None
    if isinstance(data, dict):
        return {k: _with_none_at(v, {loc[1:] for loc in locs if loc[0] == k}) for k, v in data.items()}
    if isinstance(data, list):
        return [_with_none_at(v, {loc[1:] for loc in locs if loc[0] == i}) for i, v in enumerate(data)]
    return data


def _refusal(where: str, problems: list[str], hint: str | None) -> RecipeError:
    """One problem on the error's line; several listed under it, one a line."""
    head = f"{where}: " + ("invalid recipe" if len(problems) > 1 else problems[0])
    return RecipeError(head if len(problems) == 1 else head + "\n  " + "\n  ".join(problems), hint=hint)


def _origin(loc: tuple, lines: dict[tuple, int], flags: dict[str, str]) -> str:
    """A field as recipe errors name it: its path, and the flag that set it or the line of the nearest key above it
    that the file writes."""
    field = _field(loc)
    if field in flags:
        return f"{field} (from {flags[field]})"
    probe = loc
    while probe and probe not in lines:
        probe = probe[:-1]
    return f"{field} (line {lines[probe]})" if probe in lines else field


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def load(path: str | Path | None, overrides: dict[str, Any] | None = None,
         base: dict[str, Any] | None = None, *, check_output_escape: bool = True) -> Recipe:
    """Read a recipe file (or start from ``base``), apply CLI overrides (dotted keys), and validate.

    ``overrides`` maps dotted field paths to values; ``None`` values are ignored, so a CLI can pass every flag.
    Keys in ``overrides`` may carry the flag they came from as ``"field|--flag"`` for better messages.
    """
    data: dict[str, Any] = dict(base or {})
    lines: dict[tuple, int] = {}
    twice: list[str] = []  # keys the file sets twice
    escapes: list[str] = []  # an output: outside the working folder
    where = "command line"
    if path is not None:
        p = Path(path)
        where = str(p)
        loaded, lines, twice = _read_yaml(_read_recipe_text(p), where)
        if loaded is None:
            raise RecipeError(f"{where}: the recipe is empty")
        if not isinstance(loaded, dict):
            raise RecipeError(f"{where}: a recipe must be a YAML mapping (key: value), not {type(loaded).__name__}")
        data = _merge(data, _shipped_source(loaded, p))
        output_flag = any(k.partition("|")[0] == "output" and v is not None for k, v in (overrides or {}).items())
        if check_output_escape and "output" in loaded and not output_flag:
            escapes = _outside_cwd(str(loaded["output"]), lines.get(("output",)))
    flags: dict[str, str] = {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        field, _, flag = key.partition("|")
        _set_path(data, field, value)
        flags[field] = flag or field
    if path is not None and flags:  # a flag left out (None) changed nothing
        where = f"{where} + command line"
    hint = "use a relative path inside the working folder, or pass -o/--output explicitly" if escapes else None
    recipe = validate(data, where=where, lines=lines, flags=flags, problems=twice + escapes, hint=hint)
    recipe._path = Path(path) if path is not None else None
    recipe._where, recipe._lines, recipe._flags = where, lines, flags
    return recipe


def _shipped_source(loaded: dict, path: Path) -> dict:
    """A shipped recipe names the checkout's reference model as ``models/quantkit-tiny``, a path from the checkout:
    run by name from another folder, that path read as a hub id (``org/name``) and failed as a download. Where the
    working folder has no such path, a shipped recipe's source is read from the checkout; its output stays under
    the working folder, as every recipe's does, and a user's own recipe keeps its paths as written."""
    home = shipped_dir().resolve()
    model = loaded.get("model")
    if path.resolve().parent != home or not isinstance(model, dict) or not isinstance(model.get("source"), str):
        return loaded
    source = model["source"]
    anchored = home.parent / source
    if Path(os.path.expanduser(source)).exists() or Path(source).is_absolute() or not anchored.exists():
        return loaded
    return {**loaded, "model": {**model, "source": str(anchored)}}


# Top-level keys renamed since a release: old name -> new name. A recipe that uses the old one is read as the new
# one with a note; one that uses both is refused (which of the two blocks was meant is not ours to guess).
RENAMED = {"verify": "evaluation"}


def _renamed_keys(loaded: dict, lines: dict[tuple, int], where: str) -> dict:
    """Read a recipe's old top-level keys under their new names, moving their line numbers along."""
    for old, new in RENAMED.items():
        if old not in loaded:
            continue
        if new in loaded:
            raise RecipeError(f"{where}: both '{new}:' (line {lines.get((new,), '?')}) and '{old}:' (line "
                              f"{lines.get((old,), '?')}, its earlier name) are set", hint=f"keep '{new}:' only")
        sys.stderr.write(f"note: {where}: '{old}:' is now called '{new}:' (read as it; rename it in the recipe)\n")
        loaded = {(new if k == old else k): v for k, v in loaded.items()}
        for key in [k for k in lines if k[:1] == (old,)]:
            lines[(new,) + key[1:]] = lines.pop(key)
    return loaded


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _outside_cwd(output: str, line: int | None) -> list[str]:
    """A recipe (unlike a flag the user typed) must not write outside the folder it is run from."""
    cwd = Path.cwd().resolve()
    target = (cwd / os.path.expanduser(output)).resolve()
    if target != cwd and cwd not in target.parents:
        at = f" (line {line})" if line else ""
        return [f"output{at}: {output!r} is outside the working folder {cwd}"]
    return []


def dump(recipe: Recipe) -> str:
    """The recipe as YAML, defaults filled in: what was actually run (and, read back, runs the same)."""
    return yaml.safe_dump(_shown(recipe), sort_keys=False)


def _shown(model: BaseModel) -> dict[str, Any]:
    """A model's fields as YAML data. A None is left out where leaving the field out means None (its default), and
    kept where it turns something off (a gate set to null): left out, it would read back as the default."""
    data = model.model_dump(mode="json")
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None and field.default is None:
            del data[name]
        elif isinstance(value, BaseModel):
            data[name] = _shown(value)
        elif isinstance(value, list) and value and all(isinstance(x, BaseModel) for x in value):
            data[name] = [_shown(x) for x in value]
    return data


def shipped_dir() -> Path:
    """The ``recipes/`` folder: beside the package in a checkout, or installed as package data."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "recipes", here / "recipes"):
        if cand.is_dir():
            return cand
    return here.parent / "recipes"


def find(name_or_path: str) -> Path:
    """A recipe path, or the name of a shipped recipe (``awq`` -> ``recipes/awq.yaml``)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    cand = shipped_dir() / (name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml")
    return cand if cand.exists() else p
