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
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import Field, ValidationError, model_validator

from quantkit import artifact, formats
from quantkit.errors import RecipeError
from quantkit.formats.specs import Strict


class ModelSpec(Strict):
    """The source checkpoint: a local folder or a Hugging Face hub id (optionally pinned to a revision)."""

    source: str = Field(description="local folder or hub id (org/name)")
    revision: str | None = Field(None, description="hub branch, tag or commit; recorded in the manifest")
    trust_remote_code: bool = Field(False, description="run the checkpoint's own Python code (off by default)")
    allow_pickle: bool = Field(False, description="accept .bin/.pt pickle weights (unsafe; off by default)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


class CalibrationSpec(Strict):
    """Where calibration text comes from and how much of it to use."""

    dataset: str = Field("mixed", description="shipped set (prose, code, mixed, heldout), a file, or a hub name")
    samples: int = Field(128, ge=1, le=65536)
    seq_len: int = Field(512, ge=16, le=131072)
    seed: int = Field(0, description="order in which documents are drawn; in a recipe it follows runtime.seed "
                      "(--seed) unless set here")
    field: str = Field("text", description="JSON/parquet field holding the text")
    chat_template: bool = Field(False, description="wrap each sample in the model's chat template")
    min_expert_tokens: int = Field(16, ge=0, description="warn when the router sends an MoE expert fewer "
                                   "calibration tokens than this")


class GateSpec(Strict):
    """Release gates. A gate left unset is not checked."""

    max_ppl_ratio: float | None = Field(None, gt=1.0, description="artifact ppl / baseline ppl")
    max_kld: float | None = Field(None, ge=0.0, description="mean KL(baseline || artifact), nats per token")
    min_top1: float | None = Field(None, ge=0.0, le=1.0, description="share of tokens whose argmax agrees")


class VerifySpec(Strict):
    """The evaluation protocol and its gates."""

    enabled: bool = True
    dataset: str = Field("auto", description="auto = WikiText-2 test when the hub is reachable, else heldout")
    ctx: int = Field(2048, ge=16)
    stride: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=16, description="score at most this many tokens")
    engine: Literal["auto", "transformers", "vllm", "llama.cpp"] = "auto"
    gates: GateSpec = Field(default_factory=lambda: GateSpec(max_ppl_ratio=1.5, max_kld=0.5, min_top1=0.6))


class SmokeSpec(Strict):
    """Serve the artifact in its real engine and ask it a few questions."""

    enabled: bool = True
    engine: Literal["auto", "vllm", "llama.cpp", "trtllm"] = "auto"
    timeout: float = Field(600.0, gt=0)
    python: str | None = Field(None, description="the engine's own Python (vLLM/TensorRT-LLM environments)")
    tp: int = Field(1, ge=1, description="tensor-parallel size: GPUs each smoke server spans (vLLM, TensorRT-LLM; "
                    "GGUF outputs are served on one, llama.cpp spreads layers itself)")
    tune_kernels: bool = Field(False, description="also measure every vLLM kernel for each output served by vLLM "
                               "and record the fastest `vllm serve` command (quantkit tune; needs a GPU)")


MethodSpec = Annotated[Union[formats.specs()], Field(discriminator="method")]  # type: ignore[valid-type]
METHODS = formats.methods()


class RuntimeSpec(Strict):
    """Where and how the work runs. Not part of what an artifact *is*, but recorded for reproduction."""

    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    num_gpus: int = Field(1, ge=1, description="> 1 launches llm-compressor's distributed calibration")
    seed: int = 0
    python: str | None = Field(None, description="another Python environment for this step (TensorRT-LLM)")


class Recipe(Strict):
    """A whole recipe. ``quantize`` (one artifact at ``output``) or ``outputs`` (several under ``output``)."""

    model: ModelSpec
    output: str = Field(description="artifact folder, or the release folder for several outputs")
    quantize: MethodSpec | None = None
    outputs: list[MethodSpec] | None = None
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    verify: VerifySpec = Field(default_factory=VerifySpec)
    smoke: SmokeSpec = Field(default_factory=SmokeSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)

    @model_validator(mode="after")
    def _one_seed(self) -> "Recipe":
        """``--seed`` (runtime.seed) also draws the calibration samples: one seed, as its help says. A recipe that
        sets calibration.seed itself keeps it."""
        if "seed" not in self.calibration.model_fields_set:
            self.calibration.seed = self.runtime.seed
        return self

    @model_validator(mode="after")
    def _one_shape(self) -> "Recipe":
        if (self.quantize is None) == (self.outputs is None):
            raise ValueError("give exactly one of 'quantize' (one artifact) or 'outputs' (a list of artifacts)")
        if self.outputs is not None:
            names = [formats.folder(o) for o in self.outputs]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"two outputs would write the same folder {dup[0]!r}; give each a distinct 'name'")
        return self

    def artifacts(self) -> list[tuple[MethodSpec, Path]]:
        """Each output with the folder it is written to."""
        if self.quantize is not None:
            return [(self.quantize, Path(self.output))]
        return [(o, Path(self.output) / formats.folder(o)) for o in self.outputs or []]

    def output_sha256(self, spec: Any) -> str:
        """Hash of what decides one output's bytes: the source, that output's spec, and the calibration data and
        seed only when the output reads calibration data.

        Adding an output to a recipe, changing its gates, or changing the calibration set of a recipe whose other
        outputs use none (RTN, FP8 dynamic, GGUF without an importance matrix) does not change those outputs'
        hashes, so a re-run reuses them.
        """
        relevant: dict[str, Any] = {"model": self.model.model_dump(mode="json"), "spec": spec.model_dump(mode="json")}
        given = Path(getattr(spec, "imatrix_file", None) or "").expanduser()
        if given.is_file():  # an importance matrix is an input by its bytes, not its path
            relevant["imatrix_sha256"] = artifact.sha256_file(given)
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


class _LineLoader(yaml.SafeLoader):
    """The safe loader, plus a map from each key path to the line it sits on (for error messages)."""


def _compose_lines(node: yaml.Node, path: tuple, lines: dict[tuple, int]) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            lines[path + (key,)] = k.start_mark.line + 1
            _compose_lines(v, path + (key,), lines)
            lines[path + (key,)] = k.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _compose_lines(item, path + (i,), lines)


def _read_yaml(text: str, where: str) -> tuple[Any, dict[tuple, int]]:
    try:
        node = yaml.compose(text, Loader=_LineLoader)
        data = yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{where}:{line} is not valid YAML: {getattr(e, 'problem', e)}") from None
    lines: dict[tuple, int] = {}
    if node is not None:
        _compose_lines(node, (), lines)
    return data, lines


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        if not isinstance(cur.get(k), dict):
            cur[k] = {}
        cur = cur[k]
    cur[keys[-1]] = value


def _describe(err: dict) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key (check the spelling; `quantkit recipes --schema` lists every field)"
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] in ("literal_error", "union_tag_invalid"):
        return msg.replace("Input should be", "expected")
    return msg.removeprefix("Value error, ")


def validate(data: Any, *, where: str = "recipe", lines: dict[tuple, int] | None = None,
             flags: dict[str, str] | None = None, problems: list[str] | None = None,
             hint: str | None = None) -> Recipe:
    """Validate a recipe mapping; every problem is reported with its field path, line (or flag) and expectation,
    together with ``problems`` the caller found already (so one run shows them all)."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping (key: value), not {type(data).__name__}")
    problems = list(problems or [])
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if p not in METHODS)  # drop the discriminator's tag from the path
            field = ".".join(str(p) for p in loc) or "(top level)"
            origin = ""
            if flags and field in flags:
                origin = f" (from {flags[field]})"
            elif lines:
                probe = loc
                while probe and probe not in lines:
                    probe = probe[:-1]
                if probe in lines:
                    origin = f" (line {lines[probe]})"
            got = err.get("input")
            got_s = "" if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f"; got {got!r}"
            problems.append(f"{field}{origin}: {_describe(err)}{got_s}")
    else:
        if not problems:
            return recipe
    head = f"{where}: " + ("invalid recipe" if len(problems) > 1 else problems[0])
    raise RecipeError(head if len(problems) == 1 else head + "\n  " + "\n  ".join(problems), hint=hint)


def load(path: str | Path | None, overrides: dict[str, Any] | None = None,
         base: dict[str, Any] | None = None, *, check_output_escape: bool = True) -> Recipe:
    """Read a recipe file (or start from ``base``), apply CLI overrides (dotted keys), and validate.

    ``overrides`` maps dotted field paths to values; ``None`` values are ignored, so a CLI can pass every flag.
    Keys in ``overrides`` may carry the flag they came from as ``"field|--flag"`` for better messages.
    """
    data: dict[str, Any] = dict(base or {})
    lines: dict[tuple, int] = {}
    problems: list[str] = []
    where = "command line"
    if path is not None:
        p = Path(path)
        where = str(p)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RecipeError(f"recipe {p} does not exist", hint="`quantkit recipes` lists the shipped ones") from None
        except (OSError, UnicodeDecodeError) as e:
            raise RecipeError(f"cannot read recipe {p}: {e}") from None
        loaded, lines = _read_yaml(text, where)
        if loaded is None:
            raise RecipeError(f"{where}: the recipe is empty")
        if not isinstance(loaded, dict):
            raise RecipeError(f"{where}: a recipe must be a YAML mapping (key: value), not {type(loaded).__name__}")
        data = _merge(data, loaded)
        output_flag = any(k.partition("|")[0] == "output" and v is not None for k, v in (overrides or {}).items())
        if check_output_escape and "output" in loaded and not output_flag:
            problems += _outside_cwd(str(loaded["output"]), lines.get(("output",)))
    flags: dict[str, str] = {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        field, _, flag = key.partition("|")
        _set_path(data, field, value)
        flags[field] = flag or field
    if path is not None and overrides:
        where = f"{where} + command line"
    hint = ("use a relative path inside the working folder, or pass -o/--output explicitly" if problems else None)
    return validate(data, where=where, lines=lines, flags=flags, problems=problems, hint=hint)


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
    """The recipe as YAML, defaults filled in: what was actually run."""
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_none=True), sort_keys=False)


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
