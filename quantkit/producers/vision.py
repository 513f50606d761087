"""Vision-language models in the compressed-tensors producer: the language model quantized, the vision side kept.

What a vision-language checkpoint needs beyond a causal LM, for every method of :mod:`quantkit.producers.compressed`:

* it loads as ``AutoModelForImageTextToText`` (the same class the checkpoint names), and the artifact carries the
  source's processor files (image processor, processor config, chat template) so transformers and vLLM open it
  with its processor as they opened the source;
* its vision tower and projector are never quantized (the default ignore list: the family's parts from
  :mod:`quantkit.architectures`), and after saving, :func:`check_kept` proves it: every tensor under those parts is
  in the artifact byte for byte as in the source (a quantized or re-cast vision weight fails the run, exit 1);
* llm-compressor's AWQ and SmoothQuant mappings are written for the decoder layers and also match the vision
  tower's ``q_proj``/``v_proj``..., so they are scoped to the language model (:func:`scope`): otherwise a
  mapping resolves to layers of both towers at once and llm-compressor stops ("AWQ needs to match a single
  smoothlayer");
* calibration is text-only by default (the language model is what is quantized, and its inputs are text and image
  embeddings alike); image+text samples are the recipe's ``calibration.images``.

Tested with transformers 5.17.0 and llmcompressor 0.14.0.1 on the tiny LLaVA, Qwen2.5-VL and Gemma 3 checkpoints of
``tests/vlm_models.py``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from quantkit import architectures
from quantkit.architectures import VisionLanguage
from quantkit.errors import BackendError, SourceModelError
from quantkit.manifest import open_regular
from quantkit.source import SourceModel, safetensors_header

# The files of a processor beside the tokenizer's: transformers' AutoProcessor and vLLM read them.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")
LANGUAGE_MODEL = "language_model"  # the language model's module name under the model, in every family of the table
_SHOWN = 6


def family(config: dict[str, Any]) -> VisionLanguage | None:
    """The vision side of a model, or None for a text-only one."""
    return architectures.vision_language(config)


def scope(pattern: str) -> str:
    """A mapping pattern limited to the language model: a ``re:`` pattern gets a look-ahead requiring
    ``language_model.`` in the name (what it matched inside the language model, it still matches); an exact name is
    left as it is."""
    if not pattern.startswith("re:") or LANGUAGE_MODEL in pattern:
        return pattern
    return f"re:(?=.*{LANGUAGE_MODEL}\\.){pattern[3:]}"


def scope_awq(mappings: list[Any]) -> list[Any]:
    """llm-compressor's AWQ mappings for the model, each pattern scoped to the language model."""
    from llmcompressor.modifiers.transform.awq.mappings import AWQMapping

    return [AWQMapping(scope(m.smooth_layer), [scope(b) for b in m.balance_layers],
                       **({"activation_hook_target": m.activation_hook_target}
                          if getattr(m, "activation_hook_target", None) else {}))
            for m in mappings]


def scope_modifiers(modifiers: list[Any], model: Any) -> list[str]:
    """Scope the AWQ and SmoothQuant mappings of ``modifiers`` to the language model of ``model`` (they are
    llm-compressor's own for the architecture, read from its registries as it would); the modifiers changed."""
    changed = []
    for m in modifiers:
        name = type(m).__name__
        if name == "AWQModifier":
            from llmcompressor.modifiers.transform.awq.dynamic_mappings import get_layer_mappings_from_model

            m.mappings = scope_awq(m.mappings or get_layer_mappings_from_model(model))
            changed.append(name)
        elif name == "SmoothQuantModifier":
            from llmcompressor.modifiers.transform.smoothquant.dynamic_mappings import (
                get_layer_mappings_from_model as smoothquant_mappings)

            m.mappings = [[[scope(b) for b in balance], scope(smooth)]
                          for balance, smooth in (m.mappings or smoothquant_mappings(model))]
            changed.append(name)
    return changed


def copy_processor(source: Path, out: Path) -> list[str]:
    """Copy the source's processor files into the artifact; the names copied."""
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def _tensors(files: list[Path], vl: VisionLanguage) -> dict[str, tuple[Path, dict[str, Any], int]]:
    """The kept parts' tensors of a checkpoint: name -> (file, header entry, start of the data section)."""
    out = {}
    for f in files:
        header, data_len = safetensors_header(f)
        start = f.stat().st_size - data_len  # the data section follows the 8-byte length and the header
        for name, info in header.items():
            if name != "__metadata__" and vl.kept(name):
                out[name] = (f, info, start)
    return out


def _digest(f: Path, info: dict[str, Any], data_start: int) -> str:
    """The sha256 of one tensor's bytes. The file is opened again after :func:`_tensors` read its header, and a
    source's file is the user's: opened as that was (:func:`quantkit.manifest.open_regular`), so one swapped for a
    FIFO meanwhile is refused (exit 2, naming it), never waited on."""
    begin, end = info["data_offsets"]
    with open_regular(f, SourceModelError) as fh:
        fh.seek(data_start + begin)
        return hashlib.sha256(fh.read(end - begin)).hexdigest()


def check_kept(source: SourceModel, out: Path, vl: VisionLanguage) -> dict[str, Any]:
    """Prove the vision tower and projector left quantization as they came in: every source tensor under the kept
    parts is in the artifact with the same name, dtype, shape and bytes, and the artifact has no other tensor under
    them (no ``weight_packed``/``weight_scale`` of a quantized vision layer). Raises :class:`BackendError` (exit 1,
    nothing published) naming what differs; returns the manifest's ``quantization.vision`` record."""
    src = _tensors([f for f in source.weight_files if f.suffix == ".safetensors"], vl)
    made = _tensors(sorted(out.glob("*.safetensors")), vl)
    if not src:
        raise BackendError(f"{source.spec} has no tensors under its vision parts ({', '.join(vl.keep)}): the "
                           f"architecture table's {vl.family} row does not fit this checkpoint")
    missing = sorted(set(src) - set(made))
    extra = sorted(set(made) - set(src))
    changed = sorted(n for n in set(src) & set(made)
                     if (src[n][1]["dtype"], src[n][1]["shape"]) != (made[n][1]["dtype"], made[n][1]["shape"])
                     or _digest(*src[n]) != _digest(*made[n]))
    if missing or extra or changed:
        parts = [f"{len(v)} {what}: {', '.join(v[:_SHOWN])}" + (f" (+{len(v) - _SHOWN} more)" if len(v) > _SHOWN else "")
                 for what, v in (("missing from the artifact", missing), ("added (quantized?)", extra),
                                 ("changed", changed)) if v]
        raise BackendError(f"the vision tower and projector ({', '.join(vl.keep)}) must stay as the source has them, "
                           "nothing was written: " + "; ".join(parts),
                           hint="check the ignore list (the vision parts must not be quantized)")
    params = 0
    for _, info, _ in src.values():
        n = 1
        for d in info["shape"]:
            n *= int(d)
        params += n
    dtypes = sorted({info["dtype"] for _, info, _ in src.values()})
    return {"family": vl.family, "kept": list(vl.keep), "tensors": len(src), "parameters": params,
            "dtypes": dtypes, "unchanged": True}


def record_ignored(out: Path, model: Any, ignore: list[str]) -> int:
    """Add the in-memory names of every ignored ``Linear`` to ``config.json``'s ``quantization_config.ignore``.

    compressed-tensors 0.19 writes the ignore list in the checkpoint's spelling (``vision_tower.…``,
    ``language_model.lm_head`` for LLaVA), which vLLM reads (its name mapper works from that spelling), while
    transformers 5.17 matches the list against its in-memory names (``model.vision_tower.…``, ``lm_head``): with
    only the first, transformers would wrap the vision tower and ``lm_head`` as quantized layers and initialise them
    at random (a load warning, then wrong numbers). Both spellings make both engines keep them, and the family's
    ``re:`` patterns cover the spellings of engines that nest the tower further. Returns how many were added."""
    import json

    import torch
    from compressed_tensors.utils import is_match

    path = out / "config.json"
    config = json.loads(path.read_text())
    qc = config.get("quantization_config") or {}
    written = list(qc.get("ignore") or [])
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_match(n, m, ignore)]
    # And the vision parts as patterns: vLLM 0.26 names Gemma 3's tower vision_tower.vision_model.encoder..., a
    # spelling neither list has, and took its layers for quantized ones (measured on the H200).
    vl = family(config)
    patterns = vl.ignore_patterns() if vl else []
    added = [n for n in names + patterns if n not in written]
    if added:
        qc["ignore"] = written + added
        config["quantization_config"] = qc
        path.write_text(json.dumps(config, indent=2) + "\n")
    return len(added)


def image_samples(source: Path, samples: list[list[int]], pictures: list[Any], seq_len: int) -> list[dict[str, Any]]:
    """Image+text calibration samples: sample ``i`` is picture ``i mod n`` with the shipped question (the model's
    own prompt format, :func:`quantkit.images.prompt_inputs`), followed by text sample ``i`` cut so the whole is
    ``seq_len`` tokens. Every sample carries an image: llm-compressor traces the model once, on the first sample's
    inputs, and a text-only sample after an image one would not fit that graph."""
    import torch

    from quantkit import images
    from quantkit.errors import UsageError

    out = []
    prompts = [images.prompt_inputs(source, p)[0] for p in pictures]
    for i, text in enumerate(samples):
        prompt = prompts[i % len(prompts)]
        room = seq_len - prompt["input_ids"].shape[1]
        if room < 16:
            raise UsageError(f"--seq-len {seq_len} leaves no room for text after an image prompt of "
                             f"{prompt['input_ids'].shape[1]} tokens", hint="raise --seq-len")
        tail = torch.tensor([text[:room]], dtype=torch.long)
        out.append(images.extend(prompt, tail))
    return out

