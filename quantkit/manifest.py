"""``quantkit.json``: the typed manifest of an artifact, and the one place that reads and writes it.

``quantkit.json`` records what the artifact is and how it was made, and the sha256 of every file, which
:func:`quantkit.integrity.verify` re-checks (tampering, bit rot, an incomplete copy). It is one typed object,
:class:`Manifest`, written by :func:`write_manifest` (for :meth:`quantkit.artifact.ArtifactWriter.commit` and
:func:`quantkit.integrity.update_manifest`) and read by :func:`read_manifest` only: nothing else opens the file.
It is written whole or not at all (:func:`write_text_atomic`, which the reports quantkit writes beside it use too).
``schema_version`` says which layout a file has; :func:`read_manifest` still opens the layout of earlier quantkit
versions (schema 1).

An artifact's *size* is one thing everywhere (summaries, ``inspect``, ``eval``, bits per weight): the bytes of
its weight files (:func:`size_bytes`). Configs, tokenizers and reports are not counted, nor the second copy of the
weights in a legacy layout's subfolder (:attr:`Manifest.legacy_bytes`).

A module of its own because most of quantkit only reads what an artifact is (``inspect``, ``eval``, the engines,
reuse): none of it needs the writer's folder swaps (:mod:`quantkit.artifact`) or the seal's checks
(:mod:`quantkit.integrity`), and both of those build on this. Being the floor every reader of an artifact or a
checkpoint stands on, it also holds how they open a user's file (:func:`open_regular`: a FIFO or a device refused,
never waited on).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import platform as _platform
import re
import stat
import sys
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantkit import __version__
from quantkit.errors import IntegrityError, QuantkitError, UsageError
from quantkit.locks import LOCK
from quantkit.progress import fmt_bytes

MANIFEST = "quantkit.json"
SCHEMA_VERSION = 3  # 1: quantkit 0.1.0 before the typed manifest (key "schema"; source path as typed)
# 2: the artifact's kind under the key "format" (renamed "kind": "format" named the kind, not a layout)
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest lists files and figures: kilobytes; more is not one (read bounded)
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".engine")
TEMPORARY = re.compile(r"\..+\.tmp-[0-9]+")  # write_text_atomic's, left only by a process killed mid-write


def is_artifact_file(p: Path, root: Path) -> bool:
    """Whether a file under the artifact folder ``root`` is one of the artifact's (what the manifest lists): all but
    its own manifest, ``root/quantkit.json``, and quantkit's lock files (``.NAME.lock``,
    :func:`quantkit.locks.output_lock`). Any name ending in ``.lock`` was left out, so a ``payload.lock`` added to
    a sealed artifact passed verify; any file named ``quantkit.json`` was, so one in a subfolder was never sealed
    and verify could not see it change."""
    own = p.name == MANIFEST and os.path.abspath(p.parent) == os.path.abspath(root)
    return not own and not LOCK.fullmatch(p.name)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def is_weight_file(name: str) -> bool:
    """Whether a file holds weights (what an artifact's size and bits per weight count)."""
    return name.endswith(WEIGHT_SUFFIXES)


def size_bytes(path: Path) -> int:
    """The size of an artifact (or of one .gguf file): the bytes of its weight files, from its manifest when it has
    one (what was sealed), else from the disk."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    if (path / MANIFEST).exists():
        return read_manifest(path).size_bytes
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and is_weight_file(p.name))


def inside_name(name: str) -> bool:
    """Whether a file name a seal lists (a manifest's ``files``, a line of :data:`quantkit.integrity.SUMS`) names a
    file inside the folder: relative, with no ``..`` and no NUL. Anything else would make verify read (and vouch
    for) a file elsewhere; whether a symbolic link inside leads out is checked on disk (:mod:`quantkit.integrity`)."""
    rel = PurePosixPath(name)
    return bool(name) and "\0" not in name and not rel.is_absolute() and ".." not in rel.parts and bool(rel.parts)


class Section(BaseModel):
    """A manifest section. Fields a newer quantkit added are kept as they are, never dropped on rewrite."""

    model_config = ConfigDict(extra="allow")


class SourceInfo(Section):
    """The source checkpoint as it was vetted.

    ``id`` is the model as the user named it (a hub id, or a path as typed: the model card shows it), ``path`` the
    resolved absolute folder it was read from (the hub cache for a hub id: ``hub``), and ``made_in`` the working
    folder of the run, so a relative ``id`` can be found again from anywhere (:meth:`local_path`).
    """

    id: str
    path: str
    hub: bool = False
    made_in: str | None = None
    revision: str | None = None
    architecture: str = "?"
    model_type: str = "?"
    config_sha256: str
    weights_sha256: str | None = None  # every weight file's bytes (quantkit.file_hashes); None: an older manifest
    size_bytes: int = 0
    parameters: int = 0

    def local_path(self) -> Path | None:
        """The source's folder on this machine, if it is still there: ``path``, then ``id`` relative to the folder
        the artifact was made in, then ``id`` as it stands (relative to here)."""
        candidates = [Path(self.path).expanduser()]
        if self.made_in:
            candidates.append(Path(self.made_in) / Path(self.id).expanduser())
        candidates.append(Path(self.id).expanduser())
        return next((c for c in candidates if (c / "config.json").exists()), None)


class CalibrationInfo(Section):
    """The calibration tokens: where from, how many, and the sha256 of the exact ids."""

    dataset: str
    kind: str
    source_sha256: str | None = None
    samples: int
    seq_len: int
    seed: int = 0
    chat_template: bool = False  # whether the samples went through the model's chat template
    chat_template_setting: bool | str | None = None  # what was asked: auto, true, false (None: older)
    tokens: int
    tokens_sha256: str
    tokens_reused: bool = False  # taken from the calibration token cache (quantkit.token_cache), not tokenized again
    # the source's documents the samples were made from (empty ones left out), and how many of them repeat an earlier
    # one exactly (quantkit.calibration.repeated): a release can refuse a set saved twice. None: an older manifest,
    # which did not count them (0 would say it had none)
    documents: int | None = None
    repeated_documents: int | None = None
    images: int = 0  # image+text samples of a vision-language model: how many images, their bytes' sha256
    images_source: str | None = None
    images_sha256: str | None = None


class FileInfo(Section):
    """One file's seal. The digest's form is checked on reading: one in capitals, or not hex, compared unequal to
    every file's and read as "changed", where the manifest itself is what is wrong."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class EnvironmentInfo(Section):
    python: str = Field(default_factory=lambda: sys.version.split()[0])
    platform: str = Field(default_factory=_platform.platform)
    machine: str = Field(default_factory=_platform.machine)


class EvaluationInfo(Section):
    """``quantkit eval``'s figures for this artifact (one row per model file in ``results``)."""

    created: str | None = None
    protocol: dict[str, Any] | None = None
    results: list[dict[str, Any]] = Field(default_factory=list)
    passed: bool | None = None
    summary: dict[str, Any] | None = None
    # An FP4 W4A4 artifact: the arithmetic its figures measured (quantkit.engines.numerics: "w4a4", "emulated w4a4",
    # "weight-only (Marlin FP4: this GPU has no FP4 arithmetic)", ...); None for every other artifact and older files.
    numerics: str | None = None
    # ``quantkit eval --tasks``: lm-eval task accuracy against the baseline, one row per task and metric (baseline,
    # artifact, recovery, standard errors, engine, few-shot, limit, task sha256) and the recovery gates
    # (quantkit.tasks.results.TaskReport.manifest); kept when the perplexity evaluation is re-run, and vice versa.
    tasks: dict[str, Any] | None = None


class SmokeInfo(Section):
    """``quantkit smoke``'s runs, keyed by engine (and GGUF file)."""

    updated: str | None = None
    runs: dict[str, dict[str, Any]] = Field(default_factory=dict)


class ServingInfo(Section):
    """``quantkit tune``'s kernel sweep in vLLM: each configuration's TTFT and decode tokens/s, the choice, and the
    ``vllm serve`` command that uses it (:mod:`quantkit.engines.vllm.tune`)."""

    updated: str | None = None
    measurements: list[dict[str, Any]] = Field(default_factory=list)
    choice: dict[str, Any] | None = None
    command: dict[str, Any] | None = None
    table: str = ""


class PipelineInfo(Section):
    """What ``quantkit run`` recorded: under which verification settings, and its evaluation, smoke and gates."""

    verification_sha256: str | None = None
    evaluation: dict[str, Any] | None = None
    smoke: dict[str, Any] | None = None
    gates: list[dict[str, Any]] = Field(default_factory=list)


class Manifest(Section):
    """``quantkit.json``: what an artifact is, how it was made, and the seal over its files."""

    schema_version: int = SCHEMA_VERSION
    quantkit_version: str = __version__
    created: str = Field(default_factory=now_iso)
    updated: str | None = None
    kind: str = Field(description="what the artifact is: compressed-tensors, gguf, ... (``format`` before schema 3)")
    method: str
    params: dict[str, Any] = Field(default_factory=dict)
    quantization: dict[str, Any] = Field(default_factory=dict)
    source: SourceInfo
    calibration: CalibrationInfo | None = None
    recipe: dict[str, Any] = Field(default_factory=dict)
    recipe_yaml: str = ""
    recipe_sha256: str | None = None
    output_sha256: str | None = None
    runtime: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    evaluation: EvaluationInfo | None = None
    smoke: SmokeInfo | None = None
    serving: ServingInfo | None = None
    pipeline: PipelineInfo | None = None
    environment: EnvironmentInfo = Field(default_factory=EnvironmentInfo)
    files: dict[str, FileInfo] = Field(default_factory=dict)

    @field_validator("files")
    @classmethod
    def _files_inside(cls, files: dict[str, FileInfo]) -> dict[str, FileInfo]:
        """Every file the seal lists is inside the artifact (:func:`inside_name`): a manifest naming ``../x`` or
        ``/etc/hostname`` is not one quantkit wrote, refused when read, like any other corrupt manifest."""
        # and named as quantkit names them (``a/b``: what verify compares with the files it finds)
        bad = [name for name in files if not inside_name(name) or PurePosixPath(name).as_posix() != name]
        if bad:
            raise ValueError(f"{bad[0]!r} is not the name of a file inside the artifact folder")
        return files

    @property
    def size_bytes(self) -> int:
        """The artifact's size: bytes of its weight files (see the module docstring), the model's own layout only:
        a ``--format gptq``/``autoawq`` artifact's second copy of the same weights (:attr:`legacy_bytes`) would
        double it, and make an int4 model look larger than its source."""
        return sum(f.size for _, f in self._weight_files(legacy=False))

    @property
    def legacy_bytes(self) -> int:
        """The bytes of the weight files of the legacy layout's copy (``quantization.legacy.path``: ``gptq/`` or
        ``autoawq/``); 0 for an artifact without one."""
        return sum(f.size for _, f in self._weight_files(legacy=True))

    def _weight_files(self, legacy: bool) -> list[tuple[str, FileInfo]]:
        """The weight files of the model's layout, or (``legacy``) of the legacy copy's folder."""
        home = self.quantization.get("legacy")
        folder = home.get("path") if isinstance(home, dict) else None
        copy = PurePosixPath(folder) if isinstance(folder, str) and folder else None
        return [(name, f) for name, f in self.files.items()
                if is_weight_file(name) and (copy is not None and copy in PurePosixPath(name).parents) == legacy]

    @property
    def recipe_gates(self) -> dict[str, Any] | None:
        """The verification gates of the recipe that made it (None when it set none)."""
        block = self.recipe.get("evaluation") or self.recipe.get("verify") or {}  # "verify": its earlier name
        return block.get("gates") or None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = MANIFEST) -> "Manifest":
        """Read any schema version quantkit has written (1: ``"schema": 1``, no ``made_in``)."""
        if not isinstance(data, dict):
            raise IntegrityError(f"{where} does not hold a JSON object")
        data = dict(data)
        if "schema_version" not in data:
            data["schema_version"] = data.pop("schema", 1)
            source = data.get("source")
            if isinstance(source, dict) and "hub" not in source:  # schema 1 wrote a local path as typed
                data["source"] = {**source, "hub": source.get("path") != source.get("id")}
        if type(data["schema_version"]) is not int:
            raise IntegrityError(f"{where} is not a quantkit manifest: schema_version is not a whole number")
        if data["schema_version"] < 3 and "format" in data and "kind" not in data:
            data["kind"] = data.pop("format")
        if data["schema_version"] > SCHEMA_VERSION:
            raise UsageError(f"{where} has manifest schema {data['schema_version']}, newer than this quantkit "
                             f"reads ({SCHEMA_VERSION})", hint="upgrade quantkit")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            field_ = ".".join(str(p) for p in first["loc"])
            raise IntegrityError(f"{where} is not a quantkit manifest: {field_}: {first['msg']}") from None


def refuse_special(path: Path, error: type[QuantkitError] = IntegrityError, mode: int | None = None) -> None:
    """Raise ``error`` naming ``path`` when it is a FIFO, a socket or a device, a link to one followed (``mode``: its
    ``st_mode``, where known). Reading a FIFO no one writes waits for ever and a device such as /dev/zero never
    ends, so a config.json, a manifest or a weight file that was one hung the command reading it. ``error`` is the
    reader's: :class:`IntegrityError` (exit 1) for an artifact's files, ``SourceModelError`` (exit 2) for a
    source's. A regular file, a folder or nothing at all passes: whoever opens it says what is wrong."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise error(f"{path} is {what}, not a file: reading it would never end",
                hint="put the file itself there (copy, download or re-create it), or remove it")


def refuse_special_files(folder: Path, error: type[QuantkitError] = IntegrityError) -> None:
    """:func:`refuse_special` for every entry of ``folder`` (``error`` as there): before its files go to readers
    that do not open them through :func:`open_regular`, a library's tokenizer or loader among them."""
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        refuse_special(p, error)


def open_regular(path: Path, error: type[QuantkitError] = IntegrityError) -> BinaryIO:
    """``path`` opened to read bytes, if it is a regular file (:func:`refuse_special` raises ``error`` otherwise):
    how quantkit opens a file a user gave it. Checked before the open, so a device is never opened (opening one
    may act), and again on the open file, which is opened without blocking: a FIFO put in its place meanwhile is
    refused too, never waited on. A folder is :class:`IsADirectoryError`, as :func:`open` says it."""
    refuse_special(path, error)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        refuse_special(path, error, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_capped(path: Path, limit: int, error: type[QuantkitError] = IntegrityError) -> bytes | None:
    """A small file's bytes, reading at most ``limit`` + 1 of them: None when it is larger, so a manifest or config
    that is really something huge is refused without being read whole (the caller says what it is not). A FIFO,
    a socket or a device is ``error`` (:func:`open_regular`)."""
    with open_regular(path, error) as f:
        raw = f.read(limit + 1)
    return None if len(raw) > limit else raw


def read_manifest(root: Path) -> Manifest:
    """The manifest of an artifact folder; raises :class:`UsageError` when there is none, :class:`IntegrityError`
    when it is unreadable."""
    path = Path(root) / MANIFEST
    if not path.exists():
        raise UsageError(f"{root} has no {MANIFEST}: it was not written by quantkit (or is incomplete)")
    try:
        raw = read_capped(path, MAX_MANIFEST_BYTES)
        if raw is None:
            raise IntegrityError(f"{path} is larger than {fmt_bytes(MAX_MANIFEST_BYTES)}: not a quantkit manifest")
        data = json.loads(raw)
    except (OSError, ValueError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise IntegrityError(f"{path} is unreadable or not JSON: {e}") from None
    except RecursionError:
        raise IntegrityError(f"{path} is not a quantkit manifest: nested too deeply") from None
    return Manifest.from_json(data, str(path))


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a hidden temporary file and rename: an interrupted write leaves the old file or none,
    never a truncated one that reads as complete (a report, a SHA256SUMS)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_manifest(root: Path, manifest: Manifest) -> None:
    write_text_atomic(root / MANIFEST, json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n")
