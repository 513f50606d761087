"""Resolve and vet the source checkpoint before anything expensive happens.

Checks run in seconds, before hours of calibration: the folder exists and is readable, ``config.json`` is JSON,
custom code is refused unless trusted, pickle weights are refused unless allowed, every ``.safetensors`` file's
header and byte extent are consistent (a truncated download is caught here, not mid-way through calibration), a
sharded checkpoint's index and its shards agree, the weights hold the decoder layers the config builds (no more,
no fewer), and the tokenizer's files are there and parse. The parameter count is the model's, also for a quantized
checkpoint (its packed weights unpacked, the scales quantization adds left out: :func:`_parameters`). Hub ids are
downloaded with ``huggingface_hub`` (pinned to ``revision``); offline, a hub id gives one clear message.

What headers cannot show is checked when the model loads: :func:`check_unused` refuses tensors transformers reads but
the model as built does not use (dropped silently otherwise), and :func:`load_tokenizer` turns a tokenizer that does
not load into one line.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit import file_hashes
from quantkit.architectures import moe_family, text_config
from quantkit.errors import QuantkitError, SourceModelError
from quantkit.manifest import SourceInfo, open_regular, read_capped, refuse_special_files
from quantkit.recipe import ModelSpec

MAX_CONFIG_BYTES = 16 << 20  # config.json is kilobytes; read bounded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass
class SourceModel:
    """A vetted local checkpoint and what the manifest records about it."""

    spec: str
    path: Path
    revision: str | None
    config: dict
    config_sha256: str
    weight_files: list[Path] = field(default_factory=list)
    size_bytes: int = 0
    num_parameters: int = 0
    is_pickle: bool = False
    from_hub: bool = False
    _weights: Future[str] | None = field(default=None, init=False, repr=False, compare=False)

    def hash_weights(self) -> None:
        """Start hashing the weight files in the background (a producer calls this before the work it overlaps);
        :meth:`weights_sha256` waits for it. Once started, never again for this object."""
        if self._weights is not None:
            return
        self._weights = Future()
        done = self._weights

        def work() -> None:
            try:
                done.set_result(file_hashes.digest(self.weight_files, self.path))
            except BaseException as e:  # handed to whoever waits
                done.set_exception(e)

        threading.Thread(target=work, name="source-sha256", daemon=True).start()  # daemon: an exit never waits

    def weights_sha256(self) -> str:
        """One sha256 over every weight file's name and bytes (:mod:`quantkit.file_hashes`: hashed once per version
        of each file): what says two checkpoints with the same config hold the same weights."""
        self.hash_weights()
        assert self._weights is not None
        return self._weights.result()

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or ["?"]
        return archs[0]

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "?"))

    def manifest(self) -> SourceInfo:
        """The manifest's ``source``: the name as given, the resolved folder, and the folder the run was in."""
        return SourceInfo(id=self.spec, path=str(self.path.resolve()), hub=self.from_hub, made_in=str(Path.cwd()),
                          revision=self.revision, architecture=self.architecture, model_type=self.model_type,
                          config_sha256=self.config_sha256, weights_sha256=self.weights_sha256(),
                          size_bytes=self.size_bytes, parameters=self.num_parameters)


def looks_like_hub_id(spec: str) -> bool:
    """``org/name`` that is not an existing path: a hub id."""
    return not Path(spec).exists() and spec.count("/") == 1 and not spec.startswith((".", "/", "~"))


def resolve(spec: ModelSpec) -> SourceModel:
    """Turn a model spec into a vetted local checkpoint (downloading from the hub if needed)."""
    path, revision = _local_path(spec)
    model = vet(path, spec=spec.source, revision=revision, trust_remote_code=spec.trust_remote_code,
                allow_pickle=spec.allow_pickle)
    model.from_hub = path != Path(os.path.expanduser(spec.source))
    if model.from_hub and spec.base_model not in (None, spec.source):
        raise SourceModelError(f"model.base_model {spec.base_model} differs from the hub source {spec.source}",
                               hint="a hub source is its own base_model: drop model.base_model")
    return model


def _local_path(spec: ModelSpec) -> tuple[Path, str | None]:
    p = Path(os.path.expanduser(spec.source))
    if p.exists():
        if spec.revision is not None:  # nothing here could honour it, and the manifest would record it as the truth
            raise SourceModelError(f"revision {spec.revision} names a hub revision, but {spec.source} is a local "
                                   "folder", hint="drop --revision (recipe: model.revision), or give the hub id")
        return p, None
    if not looks_like_hub_id(spec.source):
        raise SourceModelError(f"model path {spec.source} does not exist",
                               hint="give a local checkpoint folder or a hub id like org/name")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        local = snapshot_download(spec.source, revision=spec.revision, allow_patterns=HUB_PATTERNS)
    except RepositoryNotFoundError:
        raise SourceModelError(f"hub model {spec.source} does not exist or is private",
                               hint="check the id, or log in with `hf auth login`") from None
    except LocalEntryNotFoundError:
        raise SourceModelError(
            f"cannot download {spec.source} from the Hugging Face hub: it is not reachable and no cached copy exists",
            hint="check the network (or HF_HUB_OFFLINE), or pass a local checkpoint folder") from None
    except (HfHubHTTPError, OSError) as e:
        raise SourceModelError(f"cannot download {spec.source} from the Hugging Face hub: {e}",
                               hint="check the network and the revision, or pass a local folder") from None
    local_path = Path(local)
    return local_path, spec.revision or local_path.name


def vet(path: Path, *, spec: str | None = None, revision: str | None = None, trust_remote_code: bool = False,
        allow_pickle: bool = False) -> SourceModel:
    """Every cheap check on a local checkpoint folder; raises :class:`SourceModelError` with what to do."""
    if not path.is_dir():
        raise SourceModelError(f"model path {path} is not a folder",
                               hint="give the checkpoint folder that holds config.json")
    if not os.access(path, os.R_OK | os.X_OK):
        raise SourceModelError(f"model folder {path} is not readable (permission denied)")
    refuse_special_files(path, SourceModelError)  # what quantkit and the libraries read after it: none may block
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise SourceModelError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    config, raw = _read_json(cfg_path, MAX_CONFIG_BYTES, "a model config")
    if not isinstance(config, dict):
        raise SourceModelError(f"{cfg_path} must hold a JSON object")
    check_config_sizes(config, cfg_path)
    _check_architectures(config, cfg_path)
    if config.get("auto_map") and not trust_remote_code:
        raise SourceModelError(
            f"{path} asks to run its own Python code (config.json has auto_map: "
            f"{_names(config['auto_map'])}); quantkit does not run a checkpoint's code unless told to",
            hint="read that code first, then pass --trust-remote-code (recipe: model.trust_remote_code: true)")
    weight_map = _read_index(path)
    safet = _weight_files(path, weight_map)
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    is_pickle = False
    if not safet:
        if pickles and not allow_pickle:
            raise SourceModelError(
                f"{path} holds only pickle weights ({', '.join(p.name for p in pickles[:3])}); loading pickle can "
                "run arbitrary code",
                hint="convert the checkpoint to safetensors (`quantkit gguf` reads nothing else), or, if you trust "
                     "its origin, pass --allow-pickle (recipe: model.allow_pickle: true) to a verb that has it")
        if not pickles:
            raise SourceModelError(f"{path} has no weight files (*.safetensors)")
        is_pickle = True
    total, elements = 0, 0
    headers: dict[Path, tuple[dict[str, Any], int]] = {}  # each safetensors file's header and data length
    for f in safet if safet else pickles:
        if f.suffix == ".safetensors":
            header, data_len = safetensors_header(f)
            elements += _check_entries(f, header, data_len)
            headers[f] = header, data_len
        total += f.stat().st_size
    tensors = {f.name: [name for name in header if name != "__metadata__"] for f, (header, _) in headers.items()}
    quantization = _quantization_config(path, config)
    params = elements if quantization is None else _parameters(headers, _value_bits(quantization))
    _check_index(path, weight_map, tensors)
    _check_layers(path, config, [name for names in tensors.values() for name in names])
    _check_tokenizer(path)
    _check_generation_config(path)
    return SourceModel(spec=spec or str(path), path=path, revision=revision, config=config,
                       config_sha256=hashlib.sha256(raw).hexdigest(), weight_files=safet or pickles,
                       size_bytes=total, num_parameters=params, is_pickle=is_pickle)


def tensor_names(path: Path) -> list[str]:
    """The tensor names of a checkpoint's safetensors files, from their headers (the files the loaders read: the
    shards its index names, else every ``.safetensors`` file): what decides how the load builds its modules before
    anything is read (:func:`quantkit.producers.moe.per_expert_checkpoint`)."""
    return [name for f in _weight_files(path, _read_index(path))
            for name in safetensors_header(f)[0] if name != "__metadata__"]


def _names(auto_map: Any) -> str:
    """auto_map's classes for a message, whatever JSON it holds."""
    return ", ".join(sorted(map(str, auto_map))) if isinstance(auto_map, (dict, list)) else str(auto_map)[:200]


def _read_json(f: Path, cap: int, what: str) -> tuple[Any, bytes]:
    """A JSON file of the checkpoint, read bounded, and its bytes; one line naming the file when it is too large,
    unreadable or not JSON (a download cut short)."""
    try:
        raw = read_capped(f, cap, SourceModelError)
        if raw is None:
            raise SourceModelError(f"{f} is larger than {cap >> 20} MiB: not {what}")
        return json.loads(raw), raw
    except PermissionError:
        raise SourceModelError(f"{f} is not readable (permission denied)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SourceModelError(f"{f} is not valid JSON: {str(e) or 'nested too deeply'}",
                               hint="the download may be incomplete; fetch the checkpoint again") from None


def _check_generation_config(path: Path) -> None:
    """``generation_config.json``, where there is one, is a JSON object: transformers replaces one it cannot read by
    defaults built from config.json, without a word, and the artifact would ship those (the reference model's EOS
    list [1, 3] became 1: generation would stop at other tokens)."""
    f = path / "generation_config.json"
    if f.is_file() and not isinstance(_read_json(f, MAX_CONFIG_BYTES, "a generation config")[0], dict):
        raise SourceModelError(f"{f} must hold a JSON object", hint="fetch the checkpoint again, or remove the file")


def _check_architectures(config: dict[str, Any], where: Path) -> None:
    """``architectures`` is a list of class names: a bare string would be read one letter per class (the manifest's
    architecture "L", llama.cpp's converter asked for model "L", vLLM's registry likewise)."""
    archs = config.get("architectures")
    if isinstance(archs, str):
        raise SourceModelError(f"{where} is not a usable config: architectures is the string {archs[:100]!r}, "
                               "not a list of class names",
                               hint=f"write it as a list: \"architectures\": [{json.dumps(archs[:100])}]")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise SourceModelError(f"{where} is not a usable config: architectures is {str(archs)[:100]!r}, expected a "
                               "list of class names such as [\"LlamaForCausalLM\"]")


# ----------------------------------------------------------------------------------------------------------------
# A sharded checkpoint: its index and its shards

INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # an index is a few MB for the largest models; read bounded
# Mistral's repositories ship their own format's copy of the weights (consolidated.safetensors) beside the sharded
# Hugging Face files; neither transformers nor llama.cpp's converter reads it beside an index, so neither does vet.
OTHER_FORMAT_PREFIX = "consolidated"
_REFETCH = "the download or copy is incomplete or mixes two versions; fetch the checkpoint again"


def _read_index(path: Path) -> dict[str, str] | None:
    """A sharded checkpoint's weight map (tensor name -> shard file name), or None without an index; its shards are
    plain ``.safetensors`` files of the folder (a name with a path in it would read outside the checkpoint)."""
    index = path / INDEX
    if not index.is_file():
        return None
    data, _ = _read_json(index, MAX_INDEX_BYTES, "a safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise SourceModelError(f"{index} is not a safetensors index: it needs a weight_map of tensor names to shard "
                               "files", hint=_REFETCH)
    odd = sorted({v for v in weight_map.values()
                  if Path(v).name != v or v.startswith(".") or not v.endswith(".safetensors")})
    if odd:
        raise SourceModelError(f"{index} names {odd[0]!r} as a shard: not a .safetensors file of the folder",
                               hint=_REFETCH)
    return weight_map


def _weight_files(path: Path, weight_map: dict[str, str] | None) -> list[Path]:
    """The safetensors files the loaders read: the shards the index names, each there, and no other beside them
    (transformers would ignore it while its size, hash and tensor names counted here), Mistral's own-format copy
    left out; every ``.safetensors`` file of the folder where there is no index."""
    present = sorted(path.glob("*.safetensors"))
    if weight_map is None:
        return present
    named = sorted(set(weight_map.values()))
    absent = [n for n in named if not (path / n).is_file()]
    if absent:
        held = [f"{n} ({sum(1 for v in weight_map.values() if v == n)} tensors)" for n in absent[:3]]
        raise SourceModelError(f"{path} lacks {len(absent)} of the {len(named)} weight files its {INDEX} names: "
                               f"{', '.join(held)}{' …' if len(absent) > 3 else ''}", hint=_REFETCH)
    unnamed = [p.name for p in present if p.name not in named and not p.name.startswith(OTHER_FORMAT_PREFIX)]
    if unnamed:
        raise SourceModelError(f"{path} holds weight files its {INDEX} does not name: {', '.join(unnamed[:3])}"
                               f"{' …' if len(unnamed) > 3 else ''} (loaders read only the files the index names)",
                               hint="remove what is left over from another version, or fetch the checkpoint again")
    return [path / n for n in named]


def _check_index(path: Path, weight_map: dict[str, str] | None, tensors: dict[str, list[str]]) -> None:
    """Every tensor of the index is in the shard it names, and every tensor of a shard is in the index (llama.cpp's
    converter refuses any difference; transformers finds a misplaced tensor missing), from the shards' headers."""
    if weight_map is None:
        return
    held = {name: file for file, names in tensors.items() for name in names}
    misplaced = [(t, f) for t, f in weight_map.items() if held.get(t) != f]
    unlisted = sorted(t for t in held if t not in weight_map)
    if not (misplaced or unlisted):
        return
    parts = []
    if misplaced:
        shown = ", ".join(f"{t} (in {f}: {'in ' + held[t] if t in held else 'in no shard'})" for t, f in misplaced[:3])
        parts.append(f"{len(misplaced)} tensor(s) it names are not in the shard it names them in: {shown}")
    if unlisted:
        parts.append(f"{len(unlisted)} tensor(s) of its shards it does not name: "
                     + ", ".join(f"{t} (in {held[t]})" for t in unlisted[:3]))
    raise SourceModelError(f"{path / INDEX} does not match its shards: {'; '.join(parts)}", hint=_REFETCH)


# ----------------------------------------------------------------------------------------------------------------
# The decoder layers the config builds, against those the weights hold

# A decoder layer's tensors: model.layers.N. (language models), model.language_model.layers.N. (vision-language
# models in transformers 5), language_model.model.layers.N. (their older layout); a vision tower's layers never match.
DECODER_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")
# Multi-token prediction layers some families ship after the decoder's (DeepSeek-V3's layer 61, GLM-4.5's 46):
# transformers leaves them unused, as inference does.
MTP_LAYERS_KEY = "num_nextn_predict_layers"
_ANY_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a layer's tensor as transformers names it in memory


def _layers_key(config: dict[str, Any]) -> str:
    """Where the config says its decoder layer count: a vision-language model's in its text_config."""
    return "text_config.num_hidden_layers" if text_config(config) is not config else "num_hidden_layers"


def _mtp_layers(cfg: dict[str, Any]) -> int:
    v = cfg.get(MTP_LAYERS_KEY)
    return v if type(v) is int and 0 <= v <= MAX_SIZE else 0


def _spans(indices: list[int], most: int = 4) -> str:
    """Sorted layer numbers as ranges: ``4-7``, ``2, 5-6``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (", …" if len(runs) > most else "")


def _check_layers(path: Path, config: dict[str, Any], names: list[str]) -> None:
    """The weights hold exactly the decoder layers the config builds, from the tensor names of the headers.

    transformers builds ``num_hidden_layers`` layers whatever the checkpoint holds: tensors of layers past them are
    dropped with a load report on stderr only (a copy whose config says 4 of 8 layers became a 4-layer artifact that
    passed verify), and layers without tensors would be initialised at random. A config of no layers has nothing to
    quantize. Checkpoints whose layers are named otherwise are left to the load's check (:func:`check_unused`).
    """
    cfg = text_config(config)
    n, key = cfg.get("num_hidden_layers"), _layers_key(config)
    if n is None:
        return
    n = int(n)  # a whole number: check_config_sizes
    if n == 0:
        raise SourceModelError(f"{path / 'config.json'}: {key} is 0, a model without decoder layers: nothing to "
                               "quantize", hint="check config.json against the checkpoint's weights")
    by_layer: dict[int, list[str]] = {}
    for name in names:
        m = DECODER_LAYER.match(name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(name)
    if not by_layer:
        return
    mtp = _mtp_layers(cfg)
    extra = sorted(i for i in by_layer if i >= n + mtp)
    if extra:
        tensors = [t for i in extra for t in sorted(by_layer[i])]
        shown = ", ".join(tensors[:3]) + (f" (+{len(tensors) - 3} more)" if len(tensors) > 3 else "")
        also = f" and {MTP_LAYERS_KEY} ({mtp})" if mtp else ""
        raise SourceModelError(
            f"{path}: its weights hold decoder layer{'s' * (len(extra) > 1)} {_spans(extra)} that config.json's "
            f"{key} ({n}){also} leave{'' if mtp else 's'} out, which transformers would drop without an error: {shown}",
            hint=f"if the weights are right, config.json's {key} should be {max(by_layer) + 1 - mtp}; else fetch "
                 "the checkpoint again")
    held = sorted(i for i in by_layer if i < n)
    if len(held) < n:
        gaps = [(a + 1, b - 1) for a, b in zip([-1, *held], [*held, n]) if b - a > 1]
        missing = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:4]) + (", …" if len(gaps) > 4 else "")
        raise SourceModelError(
            f"{path}: config.json's {key} is {n} but its weights hold no tensor of layer{'s' * (n - len(held) > 1)} "
            f"{missing}, which transformers would initialise at random",
            hint=f"a weight file may be missing (fetch the checkpoint again), or {key} should be {len(held)}")


def check_unused(source: str | Path, unexpected: Iterable[str], config: dict[str, Any]) -> None:
    """Refuse tensors the checkpoint holds that the model, as its config builds it, does not use: what transformers'
    load reports as unexpected (after its own exceptions: rotary ``inv_freq`` buffers, a family's extra heads), less
    the multi-token prediction layers the config names. transformers drops them with a report on stderr only; here
    they are one line naming a few and the config field that likely disagrees (exit 2). The load's backstop for
    what :func:`vet` cannot see from tensor names (another architecture's weights under a config, a renamed layer)."""
    cfg = text_config(config)
    n = cfg.get("num_hidden_layers")
    mtp = range(int(n), int(n) + _mtp_layers(cfg)) if n is not None else range(0)

    def layer(name: str) -> int | None:
        m = _ANY_LAYER.search(name)
        return int(m.group(1)) if m else None

    keys = sorted(k for k in unexpected if (i := layer(k)) is None or i not in mtp)
    if not keys:
        return
    if n is not None and any((i := layer(k)) is not None and i >= int(n) for k in keys):
        disagrees = _layers_key(config)
    elif moe_family(cfg) and any(".experts." in k for k in keys):
        disagrees = "number of experts"
    else:
        disagrees = "architectures and model_type (these may be another architecture's weights)"
    raise SourceModelError(
        f"{source}: {len(keys)} tensor(s) of the checkpoint are not used by the model its config.json builds "
        f"(transformers would drop them): {', '.join(keys[:6])}" + (f" (+{len(keys) - 6} more)" if len(keys) > 6
                                                                     else ""),
        hint=f"config.json likely disagrees with the weights: check its {disagrees}")


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer

# The files transformers builds a tokenizer from, any one set: tokenizers' own file, a SentencePiece or tiktoken model,
# a byte-level BPE vocabulary with its merges, a WordPiece vocabulary, Mistral's tekken file.
TOKENIZER_SOURCES = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("vocab.json", "merges.txt"),
                     ("vocab.txt",), ("tekken.json",))
# Its JSON files, each parsed when vetting: a truncated download fails here in one line, not in transformers.
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json")
MAX_TOKENIZER_BYTES = 256 << 20  # the largest tokenizer.json (262,144 pieces) is about 33 MB
TOKENIZER_HINT = "copy the tokenizer files of the model it came from into the folder, or fetch the checkpoint again"


def _check_tokenizer(path: Path) -> None:
    """The tokenizer is there and its JSON files parse (tokenizer.json with its ``model``). A tokenizer of its own
    code (tokenizer_config.json's ``auto_map``) names its own files: their presence is left to its load."""
    custom = False
    for name in TOKENIZER_JSON:
        f = path / name
        if not f.is_file():
            continue
        data, _ = _read_json(f, MAX_TOKENIZER_BYTES, "a tokenizer file")
        if not isinstance(data, dict):
            raise SourceModelError(f"{f} is not a tokenizer file: it holds no JSON object", hint=TOKENIZER_HINT)
        if name == "tokenizer.json" and not isinstance(data.get("model"), dict):
            raise SourceModelError(f"{f} is not a tokenizers file: it has no \"model\" object", hint=TOKENIZER_HINT)
        custom = custom or (name == "tokenizer_config.json" and bool(data.get("auto_map")))
    if custom or any(all((path / n).is_file() for n in files) for files in TOKENIZER_SOURCES) \
            or any(path.glob("*.tiktoken")):
        return
    raise SourceModelError(f"{path} has no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json with "
                           "merges.txt", hint=TOKENIZER_HINT)


def tokenizer_file(path: Path) -> str:
    """The file a tokenizer load read first, for a message."""
    return next((n for files in TOKENIZER_SOURCES for n in files if (path / n).is_file()), "no tokenizer file")


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The source's tokenizer through transformers' AutoTokenizer. :func:`vet` checked its files; one that still does
    not load (a JSON file that parses but is not a tokenizer's, a corrupt SentencePiece model, a library it needs) is
    one line naming the folder and the file (exit 2), whatever transformers raised."""
    import logging

    from transformers import AutoTokenizer

    # AutoTokenizer reads config.json as a bare config to find the tokenizer's class; for a model type this
    # transformers does not know, that read warns of "a model of type `foo`" instantiating one of type "", a line
    # about nothing the tokenizer uses, printed before the model's own load says what is wrong in one line.
    config_log = logging.getLogger("transformers.configuration_utils")
    level = config_log.level
    config_log.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except QuantkitError:
        raise
    except Exception as e:  # transformers and tokenizers raise many types for a broken tokenizer
        said = " ".join(str(e).split())[:400]  # whole: transformers' first line may only say it listed the ways
        raise SourceModelError(f"cannot load the tokenizer of {path} ({tokenizer_file(Path(path))}): "
                               f"{type(e).__name__}: {said}", hint=TOKENIZER_HINT) from None
    finally:
        config_log.setLevel(level)


# Bytes per element of each safetensors dtype: the one table (the benches' bit counts read it too).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1}


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header (tensor name -> dtype, shape, data_offsets) and the length of its data
    section, read without touching the tensors. A FIFO or a device is refused, not read (:func:`open_regular`)."""
    try:
        with open_regular(path, SourceModelError) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file is shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                raise ValueError(f"header length {n} is larger than the file")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceModelError(f"{path} is corrupt or truncated: {e}",
                               hint="download or copy the checkpoint again") from None
    except RecursionError:
        raise SourceModelError(f"{path} is corrupt: its header is nested too deeply") from None
    if not isinstance(header, dict):
        raise SourceModelError(f"{path} is corrupt: its header is not a JSON object")
    return header, size - 8 - n


# GPTQ's and AutoAWQ's own layouts: a module's packed values (qweight), zero points, scales and column order.
LEGACY_WEIGHT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def stored_weight_tensor(leaf: str) -> bool:
    """Whether a module's tensor (its name's last part) holds what a quantized checkpoint stores for the weight:
    ``weight``, ``weight_packed``, ``weight_scale``, ``weight_zero_point``, ``weight_global_scale`` (not
    ``weight_shape``, the shape before packing), or GPTQ's and AutoAWQ's :data:`LEGACY_WEIGHT_TENSORS`. The
    producer's bits check and ``inspect`` count the same bytes, and :func:`vet` counts the weight's values alone as
    parameters (:func:`quantization_tensor`)."""
    return (leaf.startswith("weight") and leaf != "weight_shape") or leaf in LEGACY_WEIGHT_TENSORS


# ----------------------------------------------------------------------------------------------------------------
# A quantized checkpoint's parameters: the weights the model has, not the bytes that store them

# The tensor of a quantized module's stored weight (stored_weight_tensor) that holds its values, one value per
# element or several packed into one; the module's other weight tensors are scales, zero points and a column order.
WEIGHT_VALUES = ("weight", "weight_packed", "qweight")
# What quantization adds to a module beside its weight: the scales (and zero points) of its inputs, outputs and KV
# cache (compressed-tensors' input_scale, input_global_scale, k_scale; ModelOpt's pre_quant_scale for AWQ).
_ADDED_SCALE = re.compile(r"^(?:input|output|q|k|v|prob|pre_quant)_(?:scale|global_scale|zero_point)$")
# The dtypes a packed weight keeps several narrower values in: bytes (FP4 and ModelOpt's int4, two a byte) and 32-bit
# integers (compressed-tensors' pack-quantized, GPTQ's and AutoAWQ's qweight). F8 and I8 hold one value each.
_PACKED_IN = {"U8": 8, "I32": 32, "U32": 32}
_INT_CODES = {"I64": "q", "I32": "i"}  # a weight_shape's dtype -> its struct code
# ModelOpt names its schemes (quant_algo) rather than their bits: 4-bit weights in these, 8-bit in the others.
_FOUR_BIT_ALGO = re.compile(r"FP4|INT4|W4", re.IGNORECASE)


def quantization_tensor(leaf: str) -> bool:
    """Whether a quantized checkpoint's tensor (its name's last part) is one quantization added, not a parameter of
    the model: a weight's scales, zero points, global scale and column order (:func:`stored_weight_tensor` less
    :data:`WEIGHT_VALUES`), its shape before packing, and its inputs', outputs' and KV cache's scales."""
    return leaf not in WEIGHT_VALUES and (stored_weight_tensor(leaf) or leaf == "weight_shape"
                                          or bool(_ADDED_SCALE.match(leaf)))


def _quantization_config(path: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """A quantized checkpoint's quantization config: config.json's ``quantization_config``, else the
    ``quantization`` of a ModelOpt export's ``hf_quant_config.json``; None for an unquantized checkpoint."""
    q = config.get("quantization_config")
    if isinstance(q, dict):
        return q
    f = path / "hf_quant_config.json"
    if not f.is_file():
        return None
    data, _ = _read_json(f, MAX_CONFIG_BYTES, "a ModelOpt quantization config")
    q = data.get("quantization") if isinstance(data, dict) else None
    return q if isinstance(q, dict) else {}


def _value_bits(q: dict[str, Any]) -> int | None:
    """The width of a quantized checkpoint's weight values as its quantization config says, the narrowest where
    layers differ: compressed-tensors' config groups (``num_bits``), GPTQ's and AutoAWQ's ``bits``, ModelOpt's scheme
    (``quant_algo``, per layer in a mixed-precision export). What a packed weight that keeps no ``weight_shape`` is
    unpacked by; None where the config says nothing of it."""
    groups = q.get("config_groups")
    widths = [g["weights"].get("num_bits") for g in (groups.values() if isinstance(groups, dict) else ())
              if isinstance(g, dict) and isinstance(g.get("weights"), dict)]
    widths += [q.get("bits"), q.get("w_bit")]
    layers = q.get("quantized_layers")
    algos = [q.get("quant_algo")] + [v.get("quant_algo") for v in (layers.values() if isinstance(layers, dict) else ())
                                     if isinstance(v, dict)]
    widths += [4 if _FOUR_BIT_ALGO.search(a) else 8 for a in algos if isinstance(a, str)]
    return min((w for w in widths if type(w) is int and w > 0), default=None)


def _parameters(headers: dict[Path, tuple[dict[str, Any], int]], value_bits: int | None) -> int:
    """The parameters of a quantized checkpoint from its safetensors headers: each weight as the model has it (a
    packed weight's ``weight_shape``, else its values unpacked at ``value_bits`` each), every other tensor as stored,
    and none of what quantization added (:func:`quantization_tensor`). Counting stored elements instead put an
    NVFP4 checkpoint of the reference model at 7,737,656 parameters for its 10,490,112."""
    shapes = shapes_before_packing(headers)
    count = 0
    for header, _ in headers.values():
        for name, info in header.items():
            module, _, leaf = name.rpartition(".")
            if name == "__metadata__" or quantization_tensor(leaf):
                continue
            if leaf in WEIGHT_VALUES and module in shapes:
                count += shapes[module]
                continue
            numel, width = math.prod(info["shape"]), _PACKED_IN.get(info["dtype"], 0)
            packed = leaf in WEIGHT_VALUES and value_bits is not None and value_bits < width
            count += numel * width // value_bits if packed else numel
    return count


def shapes_before_packing(headers: dict[Path, tuple[dict[str, Any], int]]) -> dict[str, int]:
    """Each packed module's weight count from its ``weight_shape`` tensor (the two integers compressed-tensors stores
    beside an integer-packed weight), read from the file; one whose values are not positive is left out. The one
    reader of it: the source's parameters and ``inspect``'s bits per weight count the same weights."""
    found: dict[str, int] = {}
    for f, (header, data_len) in headers.items():
        wanted = [(name, info) for name, info in header.items() if name.endswith(".weight_shape")
                  and info["dtype"] in _INT_CODES and len(info["shape"]) == 1 and 0 < info["shape"][0] <= 8]
        if not wanted:
            continue
        start = f.stat().st_size - data_len
        with open_regular(f, SourceModelError) as fh:
            for name, info in wanted:
                lo, _ = info["data_offsets"]
                fh.seek(start + lo)
                code = _INT_CODES[info["dtype"]]
                dims = struct.unpack(f"<{info['shape'][0]}{code}", fh.read(info["shape"][0] * struct.calcsize(code)))
                if all(d > 0 for d in dims):
                    found[name.removesuffix(".weight_shape")] = math.prod(dims)
    return found


def check_safetensors(path: Path) -> int:
    """Validate a safetensors file's header against its size without reading the data; returns its element count
    (:func:`_check_entries`)."""
    header, data_len = safetensors_header(path)
    return _check_entries(path, header, data_len)


def _check_entries(path: Path, header: dict[str, Any], data_len: int) -> int:
    """A safetensors header's entries against the file's data section; returns their element count.

    A truncated or corrupt file (a partial download, a full disk during a copy) fails here in milliseconds: every
    entry needs a dtype, a shape of whole numbers >= 0 and offsets 0 <= start <= stop, its byte count must be what
    its dtype and shape take, the data section must hold every byte the header describes (a truncated file is told
    by that total and what it holds), and no two tensors may share bytes.
    """
    spans, count = [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and _whole(info.get("shape"), 0)
                and _whole(info.get("data_offsets"), 0) and len(info["data_offsets"]) == 2):
            raise SourceModelError(f"{path} is corrupt: bad header entry for {name}",
                                   hint="download or copy the checkpoint again")
        start, stop = info["data_offsets"]
        numel = math.prod(info["shape"])
        width = DTYPE_BYTES.get(info["dtype"], 0)
        if stop < start or (width and stop - start != numel * width):
            raise SourceModelError(f"{path} is corrupt: tensor {name} has {stop - start} bytes, expected "
                                   f"{numel * width if width else 'a non-negative count'}",
                                   hint="download or copy the checkpoint again")
        spans.append((start, stop, name))
        count += numel
    described = max((stop for _, stop, _ in spans), default=0)
    if described > data_len:
        raise SourceModelError(
            f"{path} is truncated: its header describes {described:,} bytes of tensor data but the file holds "
            f"{data_len:,} after the header", hint="download or copy the checkpoint again")
    spans.sort()
    for (_, a_stop, a), (b_start, b_stop, b) in zip(spans, spans[1:]):
        if b_start < a_stop and b_start < b_stop:
            raise SourceModelError(f"{path} is corrupt: tensors {a} and {b} overlap",
                                   hint="download or copy the checkpoint again")
    return count


def _whole(values: Any, low: int) -> bool:
    """A JSON list of whole numbers (not booleans), each at least ``low``."""
    return isinstance(values, list) and all(type(v) is int and v >= low for v in values)


SIZE_FIELDS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
               "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok")
MAX_SIZE = 2**40


def check_config_sizes(config: dict[str, Any], where: Path) -> None:
    """The sizes quantkit plans from (memory, context, layers, experts) are single whole numbers from 0 to 2**40,
    and ``text_config`` is an object. A config with ``hidden_size: -1``, ``1e30``, ``"big"`` or a per-layer list
    (which quantkit does not read) is refused here instead of failing deep inside a plan or a library."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise SourceModelError(f"{where} is not a usable config: text_config is not an object")
    for cfg in (config, text or {}):
        for key in SIZE_FIELDS:
            v = cfg.get(key)
            whole = type(v) is int or (type(v) is float and v.is_integer())
            if v is not None and not (whole and 0 <= v <= MAX_SIZE):
                why = "a list (one size per layer), which quantkit does not read" if isinstance(v, list) else \
                    f"{str(v)[:40]!r}, expected a whole number from 0 to 2**40"
                raise SourceModelError(f"{where} is not a usable config: {key} is {why}")
