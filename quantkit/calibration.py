"""Calibration and evaluation text: sources -> documents -> token samples, with the sha256 of the exact tokens.

Sources, in the order they are tried:

* a shipped set in ``calibration/`` by name: ``prose`` (Python docs), ``code`` (Python stdlib), ``mixed`` (both),
  ``heldout`` (the reference model's held-out evaluation split);
* a local file (the kinds :mod:`quantkit.formats.names` declares): ``.txt`` (one document per blank-line-separated
  block), ``.jsonl`` and ``.json`` (a record per line, or a JSON array of the same records; each gzip-compressed too:
  a ``text`` field or the one named by ``field``; ``messages`` for chat data), ``.parquet``;
* a Hugging Face dataset, by alias (``wikitext2``, ``pile-val``, ``c4``, ``ultrachat``) or ``org/name[:config][@split]``,
  loaded with ``datasets`` when the hub is reachable. Offline, a hub name fails with one clear message.

Plain text is packed: documents (shuffled with the seed, each followed by EOS) are concatenated and cut into
``samples`` windows of exactly ``seq_len`` tokens, so no sample is unbounded and every token counts. Chat data,
and plain text when the chat template is on, keeps one conversation per sample, rendered by the model's chat
template and truncated to ``seq_len``. Asking for more tokens than the source holds is an error, not a silent
shortfall.

Files are UTF-8 (no encoding is guessed), and every record is text or a conversation: anything else is refused naming
the file and the line or record. :func:`check` refuses, before anything loads, what building the samples would
refuse, by the same code; the build and ``--dry-run`` both run it (:func:`quantkit.plan.prepare`).

The chat template (``chat_template``: off, on or ``auto``) is llm-compressor's guidance for instruct models:
calibrate on text shaped like what the model will see when served, its turn markers and system prompt included.
``auto``, the default, turns it on for an instruct model: its tokenizer has a chat template whose assistant turns
end with its EOS token (:func:`instruct_template`); the manifest records what was asked and what was used. Measured
on SmolLM2-135M-Instruct (docs/calibration.md): GPTQ W4A16 (importance-weighted ranges) and INT8 W8A8 calibrated on
packed plain text answered "What is the capital of France?" in French, every time tried; calibrated through the
template, with documents as the assistant's reply, they answer "Paris", at the same held-out-text KLD.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit.architectures import vision_language
from quantkit.errors import CalibrationError, MissingBackendError, UsageError
from quantkit.formats.names import (FIELD_FILES_SHOWN, JSON_FILES, JSON_LINES_FILES, PARQUET_FILES, PLAIN_TEXT_FILES,
                                    TEXT_FILES_SHOWN)
from quantkit.manifest import CalibrationInfo, open_regular
from quantkit.recipe import CalibrationSpec

if TYPE_CHECKING:
    from quantkit.source import SourceModel

SHIPPED = {
    "prose": ("prose.jsonl.gz",),
    "code": ("code.jsonl.gz",),
    "mixed": ("prose.jsonl.gz", "code.jsonl.gz"),
    "heldout": ("heldout.jsonl.gz",),
}
# alias -> (dataset, config, split, field)
HUB_ALIASES: dict[str, tuple[str, str | None, str, str]] = {
    "wikitext2": ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", "text"),
    "wikitext2-train": ("Salesforce/wikitext", "wikitext-2-raw-v1", "train", "text"),
    "pile-val": ("mit-han-lab/pile-val-backup", None, "validation", "text"),
    "c4": ("allenai/c4", "en", "validation", "text"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft", "messages"),
}


# names that are a local file, there or not (never a hub id org/name): the suffixes read, and data files' others
FILE_SUFFIXES = PLAIN_TEXT_FILES + JSON_LINES_FILES + JSON_FILES + PARQUET_FILES + (".gz", ".csv", ".tsv")
# the flags and the recipe field that choose a record's text field, as a hint names them
FIELD_FLAGS = "--calib-field, calib show's --field, or the recipe's calibration.field"
EVAL_FIELD_FLAGS = "eval's --field, or the recipe's evaluation.field"  # the same, for an evaluation text


class FieldError(CalibrationError):
    """A record or column without the text field asked for, or a text field given where there is none to choose:
    its hint names the flags that choose one (:data:`FIELD_FLAGS`), which :func:`eval_text` replaces with eval's
    (:data:`EVAL_FIELD_FLAGS`)."""


def shipped_dir() -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "calibration", here / "calibration"):
        if cand.is_dir():
            return cand
    return here.parent / "calibration"


@dataclass
class Documents:
    """Raw documents from one source: either texts or chat conversations (lists of messages)."""

    source: str
    kind: str  # "shipped", "file", "hub"
    items: list[Any]
    chat: bool = False
    file_sha256: str | None = None


def load_documents(source: str, field: str = "text") -> Documents:
    """Read the documents of a calibration/evaluation source (no tokenization). A file that cannot be read as what
    its name says, or a record that is neither text nor a conversation, is a :class:`CalibrationError` naming the
    file and the line or record. A text ``field`` other than ``text`` for a source with no fields to choose from is
    refused (:func:`check_field`)."""
    check_field(source, field)
    if source in SHIPPED:
        items: list[Any] = []
        h = hashlib.sha256()
        for name in SHIPPED[source]:
            path = shipped_dir() / name
            raw = _read(path)
            items += _jsonl_items(_text(path, raw), path, "text")
            h.update(raw)
        return Documents(source, "shipped", items, file_sha256=h.hexdigest())
    path = Path(source).expanduser()
    if path.exists():
        return _load_file(path, field)
    if is_hub(source):
        return _load_hub(source, field)
    if source.lower().endswith(FILE_SUFFIXES):
        raise CalibrationError(f"no such file: {source} (looked for at {path.absolute()})",
                               hint="check the path; `quantkit calib list` shows the shipped sets")
    raise CalibrationError(
        f"text source {source!r} (calibration or evaluation) is neither a shipped set ({', '.join(SHIPPED)}), an existing file, "
        "nor a hub dataset name", hint="`quantkit calib list` shows the shipped sets")


def check_field(source: str, field: str) -> None:
    """Refuse a text field given for a source that has none to choose from: a shipped set (read by its ``text``),
    a plain-text file, or a hub alias (which names its own column). It was ignored: the run calibrated on what it
    would have without the field, and the manifest recorded the field as if it had chosen something."""
    if field == "text":
        return
    path = Path(source).expanduser()
    if source in SHIPPED:
        what = f"the shipped set {source!r}, whose records are read by their 'text' field"
    elif path.is_file() and path.name.lower().endswith(PLAIN_TEXT_FILES):
        what = f"{path}, a plain-text file (one document per blank-line-separated block)"
    elif is_hub(source) and source in HUB_ALIASES and field != HUB_ALIASES[source][3]:
        what = f"the hub dataset {source!r}, which is read by its {HUB_ALIASES[source][3]!r} column"
    else:
        return
    raise FieldError(f"text field {field!r} given for {what}: there is no field to choose",
                     hint=f"leave the field at its default (text): {FIELD_FLAGS} choose a field of "
                          f"{FIELD_FILES_SHOWN} files and of org/name hub datasets")


def check_eval_field(source: str, field: str) -> None:
    """:func:`check_field` for an evaluation text, the hint naming eval's flags; ``auto`` (evaluation's WikiText-2
    when the hub is reachable, else heldout, each read its own way) has no field to choose either. ``quantkit run``
    and its dry run check it before the first output is made, not once it is built."""
    if source == "auto" and field != "text":
        raise FieldError(f"text field {field!r} given for the evaluation text auto (WikiText-2 when the hub is "
                         "reachable, else heldout): there is no field to choose",
                         hint="give the file or org/name hub dataset whose field it is with --dataset (recipe: "
                              "evaluation.dataset)")
    with _eval_flags():
        check_field(source, field)


@contextmanager
def _eval_flags() -> Iterator[None]:
    """A :class:`FieldError` raised inside, its hint naming eval's flags (:data:`EVAL_FIELD_FLAGS`) in place of
    calibration's."""
    try:
        yield
    except FieldError as e:
        raise FieldError(e.message, hint=(e.hint or "").replace(FIELD_FLAGS, EVAL_FIELD_FLAGS)) from None


def is_hub(source: str) -> bool:
    """Whether :func:`load_documents` reads ``source`` from the Hugging Face hub: an alias, or ``org/name`` that is
    neither a shipped set nor an existing path. A name with a data file's suffix is a path, there or not: a
    mistyped ``data/calib.jsonl`` was a hub id, passed by --dry-run and refused by the run as a hub that does not
    answer."""
    if source in SHIPPED or Path(source).expanduser().exists() or source.lower().endswith(FILE_SUFFIXES):
        return False
    return source in HUB_ALIASES or ("/" in source and not source.startswith((".", "/", "~")))


def _read(path: Path) -> bytes:
    """A calibration or evaluation file's bytes; one swapped for a FIFO or a device since :func:`_load_file` looked is
    refused, not waited on (:func:`quantkit.manifest.open_regular`)."""
    try:
        with open_regular(path, CalibrationError) as f:
            return f.read()
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror or e}") from None


def _text(path: Path, raw: bytes) -> str:
    """A file's text: gunzipped when its name ends in ``.gz``, then decoded as UTF-8 and nothing else, with line
    ends read as Python's text mode reads them, and a leading UTF-8 byte order mark left out.

    No encoding is guessed: Latin-1 or cp1252 read as another encoding gives other characters, so other calibration
    tokens, with nothing to show for it. A file that is not UTF-8 is refused, naming the first byte that is not.
    The byte order mark (Windows Notepad and Excel's "UTF-8" write one) says the file is UTF-8 and is no character
    of it: kept, it was a token of a .txt's first document, and a .jsonl or .json was not valid JSON."""
    data = raw
    if path.name.lower().endswith(".gz"):
        try:
            data = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise CalibrationError(f"{path} is not a readable gzip file: {e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = " of its decompressed text" if data is not raw else ""
        line = data.count(b"\n", 0, e.start) + 1
        raise CalibrationError(
            f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}{where} (line {line})",
            hint="convert it to UTF-8 (Latin-1 text: iconv -f latin1 -t utf-8 FILE > NEW); quantkit does not guess "
                 "encodings, a wrong guess changes the calibration tokens") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _jsonl_items(text: str, path: Path, field: str) -> list[Any]:
    """The documents of JSON Lines: a record per line, each named by its line (``file:3``)."""
    items = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}:{n} is not valid JSON: {e.msg}") from None
        items.append(_pick(row, field, f"{path}:{n}"))
    return items


def _json_items(text: str, path: Path, field: str) -> list[Any]:
    """The documents of a JSON file: an array of the records a .jsonl holds (what ``datasets`` writes with
    ``to_json(lines=False)``), each named by its index (``record 3``), or an object with a ``data`` or ``rows`` array
    of them. A file of one JSON value per line (``datasets``' ``to_json`` default, whatever the name) is read as the
    JSON Lines it is. Anything else at the top level is refused, saying what it is: a single record read as a set
    of its fields was no calibration set.

    The file is parsed whole, as a .jsonl is read whole: its records are the documents, held in memory either way."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and not text.lstrip().startswith("["):  # a record, then more: JSON Lines
            return _jsonl_items(text, path, field)
        raise CalibrationError(f"{path}:{e.lineno} is not valid JSON: {e.msg}") from None
    rows = data.get("data", data.get("rows")) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise CalibrationError(f"{path}: the top level is {_json_kind(data)}; expected a JSON array of records "
                               "([{\"text\": ...}, ...]), or an object with a 'data' or 'rows' array of them",
                               hint="a file of one record per line is JSON Lines: name it .jsonl")
    return [_pick(r, field, f"{path}: record {n}") for n, r in enumerate(rows, 1)]


def _json_kind(value: Any) -> str:
    """What a JSON value is, in a few words for a message: an object by its first keys, which show whether it is one
    record (``keys: text``) rather than a set of them."""
    if isinstance(value, dict):
        keys = ", ".join(sorted(value)[:5]) + (", ..." if len(value) > 5 else "")
        return f"an object (keys: {keys})" if value else "an empty object"
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _pick(row: Any, field: str, where: str) -> Any:
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        raise CalibrationError(f"{where}: expected an object with a {field!r} field")
    if field in row:
        return _document(row[field], field, where)
    if "messages" in row:
        return _document(row["messages"], "messages", where)
    raise FieldError(f"{where}: no {field!r} field (fields: {', '.join(sorted(row))})",
                     hint=f"choose the text field with {FIELD_FLAGS}")


def _document(value: Any, field: str, where: str) -> Any:
    """One document as calibration takes it: a text, or a conversation (a list of messages, each an object with a
    string ``role`` and a string ``content``); a null is an empty document, left out like an empty text. Anything
    else is refused here, where its file and line are known, instead of failing later inside the tokenizer or the
    chat template."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in value):
        return value
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise FieldError(f"{where}: {field!r} is {shown} ({type(value).__name__}), neither text nor a list of chat "
                     "messages (objects with a string 'role' and 'content')",
                     hint=f"each record's text field must be a string; choose another field with {FIELD_FLAGS}")


def _load_file(path: Path, field: str) -> Documents:
    name = path.name.lower()
    if path.is_dir():
        raise CalibrationError(f"text source {path} is a folder; give a {TEXT_FILES_SHOWN} file")
    if not path.is_file():  # read more than once (check, build, sha256): a FIFO was waited on for ever, then empty
        raise CalibrationError(f"text source {path} is not a regular file (a FIFO, socket or device)",
                               hint="write the text to a file and give that")
    raw = _read(path)
    digest = hashlib.sha256(raw).hexdigest()
    if name.endswith(JSON_LINES_FILES):
        items = _jsonl_items(_text(path, raw), path, field)
    elif name.endswith(JSON_FILES):
        items = _json_items(_text(path, raw), path, field)
    elif name.endswith(PARQUET_FILES):
        items = _parquet_items(path, field)
    elif name.endswith(PLAIN_TEXT_FILES):
        text = _text(path, raw)
        items = [b.strip() for b in text.split("\n\n") if b.strip()]
    else:
        raise CalibrationError(f"unsupported calibration file type: {path.name}",
                               hint=f"use a {TEXT_FILES_SHOWN} file")
    # a null or empty record is no document, and no say in the file's kind: counted, one "messages": null made a file
    # of conversations plain text, each packed as "user: ..." lines instead of going through the chat template
    items = [i for i in items if i]
    chat = bool(items) and all(isinstance(i, list) for i in items)
    return Documents(str(path), "file", items, chat=chat, file_sha256=digest)


def _parquet_items(path: Path, field: str) -> list[Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingBackendError("pyarrow", "llmcompressor", "reading .parquet calibration data") from None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise CalibrationError(f"{path} is not a readable parquet file: {str(e).splitlines()[0][:200]}") from None
    col = field if field in table.column_names else ("messages" if "messages" in table.column_names else None)
    if col is None:
        raise FieldError(f"{path}: no {field!r} column (columns: {', '.join(table.column_names)})",
                         hint=f"choose the text column with {FIELD_FLAGS}")
    return [_document(v, col, f"{path}: row {n}") for n, v in enumerate(table.column(col).to_pylist(), 1)]


def _load_hub(source: str, field: str) -> Documents:
    if source in HUB_ALIASES:
        name, config, split, field = HUB_ALIASES[source]
    else:
        name, _, split = source.partition("@")
        name, _, config = name.partition(":")
        config = config or None
        split = split or "train"
    try:
        import datasets
    except ImportError:
        raise MissingBackendError("datasets", "llmcompressor", f"the hub dataset {source!r}") from None
    unreachable = _hub_unreachable(name)
    try:
        with _offline(unreachable is not None):
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types for "offline" and "not found"
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise CalibrationError(
            f"cannot load hub dataset {source!r} ({name}{':' + config if config else ''}@{split}): "
            + (f"the hub does not answer ({unreachable}), and reading the local cache failed: {why}" if unreachable
               else why),
            hint="the hub may be unreachable (offline?); use a shipped set (prose, code, mixed) or a local file") from None
    col = field if field in ds.column_names else ("messages" if "messages" in ds.column_names else None)
    if col is None:
        raise FieldError(f"hub dataset {source!r} has no {field!r} column ({', '.join(ds.column_names)})",
                         hint=f"choose the text column with {FIELD_FLAGS}")
    # Empty rows are kept: evaluation joins every row with blank lines, as the GPTQ/AWQ papers do for WikiText-2
    # (calibration drops them in build()).
    items = [_document(x, col, f"hub dataset {source!r}: row {n}") for n, x in enumerate(ds[col], 1)]
    chat = any(isinstance(i, list) for i in items)
    return Documents(source, "hub", items, chat=chat, file_sha256=getattr(ds, "_fingerprint", None))


def _hub_unreachable(name: str) -> str | None:
    """Why the hub does not answer for dataset ``name`` (one request for its card, no retries), or None when it
    does, or when offline mode is on (nothing is asked then)."""
    import datasets
    import httpx
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return None
    try:
        HfApi().dataset_info(name, timeout=10)
    except (httpx.TransportError, OfflineModeIsEnabled) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'no answer'}"
    except Exception:  # noqa: BLE001 - not found, gated, a server error: the hub answered; datasets says which
        pass
    return None


@contextmanager
def _offline(on: bool) -> Iterator[None]:
    """With ``on``, ``datasets`` and ``huggingface_hub`` in offline mode (``HF_HUB_OFFLINE``) for the block: a
    dataset the hub cannot be asked for is read from the local cache, as ``huggingface_hub`` does for a model
    (:func:`quantkit.source.resolve`), or fails at once where none is cached.

    Left to itself, ``datasets`` retries every request five times with backoff and prints each retry: without a
    network, ten lines and about 23 seconds before the same error. Both libraries read ``HF_HUB_OFFLINE`` once, when
    imported, into the switches set here; they are restored after the block."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


@dataclass
class CalibrationSet:
    """Token samples ready for a quantizer, and how they were made (for the manifest)."""

    spec: CalibrationSpec
    documents: Documents
    samples: list[list[int]]
    tokens_sha256: str

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    chat: bool = False  # whether the samples went through the chat template (what ``auto`` resolved to)
    reused: bool = False  # the tokens came from the calibration token cache (quantkit.token_cache)
    pictures: list[Any] = field(default_factory=list)  # image+text calibration: the quantkit.images.Picture used

    def manifest(self) -> CalibrationInfo:
        from quantkit import images

        return CalibrationInfo(dataset=self.spec.dataset, kind=self.documents.kind,
                               source_sha256=self.documents.file_sha256, samples=len(self.samples),
                               seq_len=self.spec.seq_len, seed=self.spec.seed, chat_template=self.chat,
                               chat_template_setting=self.spec.chat_template, tokens=self.num_tokens,
                               tokens_sha256=self.tokens_sha256, tokens_reused=self.reused,
                               documents=len(self.documents.items), repeated_documents=repeated(self.documents),
                               images=len(self.pictures),
                               images_source=self.spec.images if self.pictures else None,
                               images_sha256=images.sha256(self.pictures) if self.pictures else None)

    def texts(self, tokenizer: Any) -> list[str]:
        """The samples decoded back to text, for backends that want strings."""
        return [tokenizer.decode(s) for s in self.samples]


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence a model was trained for (``max_position_embeddings``, also inside a ``text_config``)."""
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg.get("max_position_embeddings"), int):
            return int(cfg["max_position_embeddings"])
    return None


def check_fits(spec: CalibrationSpec, config: dict[str, Any], model: str) -> None:
    """Refuse calibration samples longer than the model's context: positions it never saw calibrate nothing real
    (and the only sign would be a transformers warning lost in the output)."""
    limit = context_length(config)
    if limit is not None and spec.seq_len > limit:
        raise CalibrationError(f"--seq-len {spec.seq_len} is longer than {model}'s context "
                               f"(max_position_embeddings {limit}): calibration would run on positions the model "
                               "never saw", hint=f"use --seq-len {limit} or less")


def check_images(spec: CalibrationSpec, config: dict[str, Any], model: str) -> None:
    """Refuse image+text calibration (``--calib-images``) of a model that takes no images, or from a folder that
    holds none (the images are read, as the run reads them)."""
    if not spec.images:
        return
    from quantkit import images

    if vision_language(config) is None:
        raise UsageError(f"--calib-images: {model} is not a vision-language model",
                         hint="drop --calib-images (text calibration is what a language model takes)")
    images.load(images.folder(spec.images))


def check(spec: CalibrationSpec, source: SourceModel, *, trust_remote_code: bool = False) -> str:
    """Refuse, before anything loads, what building the calibration samples would refuse: samples longer than the
    model's context, images for a model that takes none (:func:`check_images`), and, for a shipped set or a local
    file, documents that cannot be read, none, or too few for ``samples`` x ``seq_len``. The documents are tokenized
    with the model's own tokenizer by the code :func:`build` makes the samples with, so the refusal is the run's,
    word for word; nothing is written (the token cache is the run's to fill), but the samples are kept in this
    process for :func:`build`, so a run does not tokenize its calibration set twice.

    A hub dataset is not read here: the plan stays offline, and the run reads it before the model loads. Tokens an
    earlier run made from the same documents and tokenizer files (:mod:`quantkit.token_cache`) were enough then, and
    are now: the tokenizer is not loaded (transformers' import is most of a dry run's time).

    The one check of both the build and ``--dry-run`` (:func:`quantkit.plan.prepare`). Returns what it checked, in
    a few words for the plan: how many documents repeat an earlier one among them (:func:`repeated`), which it also
    keeps for the build to warn of before its work starts (:func:`checked_repeat_warning`)."""
    from quantkit import token_cache
    from quantkit.source import load_tokenizer

    check_fits(spec, source.config, source.spec)
    check_images(spec, source.config, source.spec)
    check_field(spec.dataset, spec.field)
    if is_hub(spec.dataset):
        return "a hub dataset: read when the run starts, not checked offline"
    docs = _usable(load_documents(spec.dataset, spec.field))
    name = _cache_name(spec, docs, source.path)
    made = _checked.get(name) if name else None  # checked already in this process (another output of the recipe)
    n = repeated(docs)
    _checked_repeats[(spec.dataset, spec.field)] = (docs.source, len(docs.items), n)
    checked = f"{len(docs.items):,} documents checked" + (f" ({n:,} of {len(docs.items):,} repeat an earlier one)"
                                                          if n else "")
    if made is None and name and token_cache.read(name, tokens_sha256) is not None:  # no tokenizer to load
        return f"{checked}, their tokens made by an earlier run"
    if made is None:
        made = _tokenize(spec, load_tokenizer(source.path, trust_remote_code=trust_remote_code), docs)
        if name:
            _checked[name] = made
    return f"{checked}, {made.num_tokens:,} tokens"


_checked: dict[str, CalibrationSet] = {}  # samples check() made, by token cache name, for this process's build()
# what check() last counted of a source's documents (source as read, documents, repeats), by (dataset, field)
_checked_repeats: dict[tuple[str, str], tuple[str, int, int]] = {}


def tokens_sha256(samples: list[list[int]]) -> str:
    """sha256 over the exact token ids (int32 little-endian) with each sample's length: identical ids, same hash."""
    import numpy as np

    h = hashlib.sha256()
    for s in samples:
        h.update(len(s).to_bytes(4, "little"))
        h.update(np.asarray(s, dtype="<i4").tobytes())
    return h.hexdigest()


def build(spec: CalibrationSpec, tokenizer: Any, docs: Documents | None = None) -> CalibrationSet:
    """Tokenize a source into ``spec.samples`` samples of ``spec.seq_len`` tokens (see the module docstring); the
    same spec, documents and tokenizer files again reuse the tokens made the first time
    (:mod:`quantkit.token_cache`), which the manifest says."""
    from quantkit import token_cache

    docs = _usable(docs or load_documents(spec.dataset, spec.field))
    name = _cache_name(spec, docs, Path(str(getattr(tokenizer, "name_or_path", "") or "")))
    if name and (made := _checked.pop(name, None)) is not None:  # tokenized moments ago by check(): not reused
        token_cache.write(name, made.samples, made.chat, made.tokens_sha256)
        return made
    hit = token_cache.read(name, tokens_sha256) if name else None
    if hit is not None:
        samples, chat, digest = hit
        return CalibrationSet(spec=spec, documents=docs, samples=samples, tokens_sha256=digest, chat=chat,
                              reused=True)
    made = _tokenize(spec, tokenizer, docs)
    if name:
        token_cache.write(name, made.samples, made.chat, made.tokens_sha256)
    return made


def _cache_name(spec: CalibrationSpec, docs: Documents, tokenizer_folder: Path) -> str | None:
    """The token cache's name for these samples (:func:`quantkit.token_cache.key`), or None where none can be."""
    from quantkit import token_cache

    return token_cache.key(spec.model_dump(mode="json", exclude={"min_expert_tokens"}), docs.file_sha256,
                           tokenizer_folder)


def repeated(docs: Documents) -> int:
    """How many documents repeat an earlier one exactly, as the loader read them (a .txt block stripped, line ends
    LF, a conversation by its messages); empty documents are none. Concatenated exports or a set saved twice weigh
    each repeated text more in the samples. They are used as they are: the data is the user's, and the file's sha256
    and the token cache are of it as it is; ``calib show``, ``--dry-run`` and the run say it
    (:func:`repeat_warning`)."""
    seen: set[bytes] = set()
    count = 0
    for item in docs.items:
        if not item:
            continue
        text = item if isinstance(item, str) else json.dumps(item, sort_keys=True, ensure_ascii=False)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()  # JSON may hold a lone surrogate
        count += digest in seen
        seen.add(digest)
    return count


def repeat_warning(docs: Documents) -> str | None:
    """The run's one line about repeated documents (:func:`repeated`), or None where none repeats: for a hub dataset,
    whose documents :func:`check` leaves to the run, said once the build read them, before its producer starts
    (:func:`quantkit.api.quantize_one`; the others: :func:`checked_repeat_warning`)."""
    return _repeat_line(docs.source, sum(1 for i in docs.items if i), repeated(docs))


def checked_repeat_warning(spec: CalibrationSpec) -> str | None:
    """:func:`repeat_warning` of the documents :func:`check` read for ``spec`` in this process (a shipped set or a
    local file), so a build says it before its work starts (a GPTQ of half an hour warned only at its end) without
    reading the documents again; None where none repeats, or check read none (a hub dataset)."""
    counted = _checked_repeats.get((spec.dataset, spec.field))
    return _repeat_line(*counted) if counted else None


def _repeat_line(source: str, documents: int, n: int) -> str | None:
    """The warning for ``n`` of ``documents`` repeating an earlier one, or None where none does."""
    if not n:
        return None
    return (f"calibration source {source!r}: {n:,} of {documents:,} documents repeat an earlier one; they are used "
            "as they are, so each weighs more")


def _usable(docs: Documents) -> Documents:
    """The documents with the empty ones left out; none left is an error."""
    kept = Documents(docs.source, docs.kind, [i for i in docs.items if i], docs.chat, docs.file_sha256)
    if not kept.items:
        raise CalibrationError(f"calibration source {docs.source!r} is empty",
                               hint="give a source with text in it, or a shipped set (prose, code, mixed)")
    return kept


def _tokenize(spec: CalibrationSpec, tokenizer: Any, docs: Documents) -> CalibrationSet:
    rng = random.Random(spec.seed)
    order = list(range(len(docs.items)))
    rng.shuffle(order)
    chat = uses_chat_template(spec, tokenizer, docs)
    _refuse_packed_conversations(docs, chat)
    if chat:
        samples = _chat_samples(spec, tokenizer, docs, order)
    else:
        samples = _packed_samples(spec, tokenizer, docs, order)
    return CalibrationSet(spec=spec, documents=docs, samples=samples, tokens_sha256=tokens_sha256(samples),
                          chat=chat)


def _refuse_packed_conversations(docs: Documents, chat: bool) -> None:
    """Refuse texts and conversations in one source when the samples are packed (the chat template off): a
    conversation has no rendering but the template's, and was packed as "user: ..." lines no model is served. With
    the template on, both kinds go through it (a text as the assistant's reply), and evaluation reads such a source
    as text (:func:`eval_text`)."""
    chats = sum(isinstance(i, list) for i in docs.items)
    if chat or not chats:
        return
    texts = len(docs.items) - chats
    raise CalibrationError(
        f"calibration source {docs.source!r} holds {chats} conversation{'s' * (chats != 1)} and {texts} plain "
        f"text{'s' * (texts != 1)}, and the chat template is off: conversations go only through the chat template",
        hint="keep one kind per file (the texts in a file of their own), or render both with --chat-template "
             "(a text as the assistant's reply)")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


_PROBE = "quantkit-probe-reply"


def instruct_template(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template is one the model was tuned to answer in: its EOS token closes the
    template's assistant turn.

    An instruct checkpoint is trained to end its replies where its template ends a turn, and is published with
    that token as its EOS (SmolLM2-Instruct's and Qwen2.5-Instruct's ``<|im_end|>``, Llama-3.1-Instruct's
    ``<|eot_id|>``, Mistral-Instruct's ``</s>``). A base model that ships a template for later fine-tuning ends its
    documents with another token (quantkit-tiny's and Llama-3.1 base's ``<|end_of_text|>``, Qwen2.5 base's
    ``<|endoftext|>``), and may never have seen the template's tokens, whose embeddings are then untrained: text
    shaped by that template is not what it will be asked to continue. A checkpoint whose turns end with a token
    other than its EOS (Gemma's ``<end_of_turn>``) is judged a base model; ``--chat-template`` turns it on.
    """
    from jinja2 import TemplateError

    if not has_chat_template(tokenizer) or not tokenizer.eos_token:
        return False
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": _PROBE}], tokenize=False)
    except TemplateError:  # a template with its own rules for this conversation: not one to guess at
        return False
    return tokenizer.eos_token in text.rpartition(_PROBE)[2]


def uses_chat_template(spec: CalibrationSpec, tokenizer: Any, docs: Documents) -> bool:
    """Whether the samples go through the model's chat template.

    Chat data (conversations) always does: a conversation has no other rendering the model knows. Plain text does
    when ``chat_template`` is on, or ``auto`` (the default) and the template is the instruct model's own
    (:func:`instruct_template`), unless images calibrate too: each text sample then follows an image prompt that
    is already the template's user turn, so the text is the reply as it stands. On with no template to use is an
    error, not a silent fallback.
    """
    if docs.chat or spec.chat_template is True:
        if not has_chat_template(tokenizer):
            raise CalibrationError("the chat template is on (chat data or --chat-template) but the model's "
                                   "tokenizer has no chat template", hint="use plain-text calibration data with "
                                   "--no-chat-template")
        return True
    return spec.chat_template == "auto" and not spec.images and instruct_template(tokenizer)


def _packed_samples(spec: CalibrationSpec, tokenizer: Any, docs: Documents, order: list[int]) -> list[list[int]]:
    need = spec.samples * spec.seq_len
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id
    stream: list[int] = []
    for i in order:
        item = docs.items[i]
        text = document_text(item)
        # verbose=False: a document longer than the model's context is cut into samples; transformers' warning
        # that it is too long for the model would be about something that never reaches the model
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if bos is not None:
            stream.append(bos)
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
        if len(stream) >= need:
            break
    if len(stream) < spec.seq_len:
        raise CalibrationError(f"calibration source {docs.source!r} holds {len(stream)} tokens, fewer than one "
                               f"sample of {spec.seq_len} ({spec.samples} x {spec.seq_len} = {need} asked for)",
                               hint="use a larger source, or a shorter --seq-len")
    if len(stream) < need:
        raise CalibrationError(
            f"calibration source {docs.source!r} holds {len(stream)} tokens, fewer than the "
            f"{spec.samples} x {spec.seq_len} = {need} asked for",
            hint=f"ask for at most {len(stream) // spec.seq_len} samples of {spec.seq_len} tokens, "
                 "or use a larger source")
    return [stream[k * spec.seq_len:(k + 1) * spec.seq_len] for k in range(spec.samples)]


def conversation(item: Any) -> list[dict[str, str]]:
    """A calibration item as the messages the chat template renders: a conversation as it is; a plain document
    as the assistant's reply to an empty user turn (after the template's own default system prompt, if it has
    one). A served instruct model writes in the assistant turn, so that is where the quantizer should see it
    work; on SmolLM2-135M-Instruct this scored the lowest KLD of the two ways, the document as the user's turn
    scoring as packed plain text did (docs/calibration.md)."""
    return item if isinstance(item, list) else [{"role": "user", "content": ""}, {"role": "assistant", "content": item}]


def _chat_samples(spec: CalibrationSpec, tokenizer: Any, docs: Documents, order: list[int]) -> list[list[int]]:
    samples: list[list[int]] = []
    for i in order:
        text = tokenizer.apply_chat_template(conversation(docs.items[i]), tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][: spec.seq_len]
        samples.append(ids)
        if len(samples) == spec.samples:
            return samples
    raise CalibrationError(f"calibration source {docs.source!r} holds {len(samples)} conversations, fewer than the "
                           f"{spec.samples} asked for", hint=f"ask for at most {len(samples)} samples")


def document_text(document: str | list[dict]) -> str:
    """A document as plain text: a text itself, a conversation its messages as ``role: content`` lines (how packed
    samples, evaluation and ``calib show``'s preview read one)."""
    if isinstance(document, str):
        return document
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in document)


def eval_text(source: str, field: str = "text") -> tuple[str, Documents]:
    """One evaluation text: documents joined by blank lines (the WikiText-2 convention), and their source. A field
    error's hint names eval's own way to choose the field (calibration's named --calib-field)."""
    with _eval_flags():
        docs = load_documents(source, field)
    if not docs.items:
        raise CalibrationError(f"evaluation source {source!r} is empty")
    texts = [document_text(d) for d in docs.items]
    return "\n\n".join(texts), docs
