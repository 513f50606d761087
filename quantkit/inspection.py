"""``quantkit inspect``: say what an artifact is, from its files, and check its seal.

Works on quantkit artifacts (manifest + sha256 check; a ``.gguf`` file inside one against its folder's manifest; a
release folder artifact by artifact, then against its ``SHA256SUMS``) and on foreign ones too (a compressed-tensors,
AutoAWQ, GPTQ or ModelOpt checkpoint, a plain checkpoint, a ``.gguf`` file), reading only headers and configs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from quantkit import integrity
from quantkit.checkpoint import gguf_files, quantization_config
from quantkit.errors import IntegrityError, QuantkitError
from quantkit.formats import kinds
from quantkit.formats.names import KindName
from quantkit.manifest import Manifest, read_capped, read_manifest, refuse_special_files, size_bytes
from quantkit.source import MAX_CONFIG_BYTES, safetensors_header, shapes_before_packing, stored_weight_tensor


def _config(path: Path) -> dict[str, Any]:
    """A JSON config as a dict; a file that is not one is an :class:`IntegrityError` (exit 1) saying so."""
    try:
        raw = read_capped(path, MAX_CONFIG_BYTES)
        if raw is None:
            raise IntegrityError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config")
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{path} is unreadable or not JSON: {str(e) or 'nested too deeply'}") from None
    if not isinstance(data, dict):
        raise IntegrityError(f"{path} does not hold a JSON object")
    return data


def _obj(value: Any) -> dict[str, Any]:
    """A config section that should be an object; anything else reads as empty."""
    return value if isinstance(value, dict) else {}


def checkpoint_quantization(root: Path) -> dict[str, Any]:
    """Format, bits and scheme of a Hugging Face checkpoint folder, from its config files.

    A compressed-tensors checkpoint may hold several config groups (a ``--target-bits`` mix): each is described in
    ``groups`` (lowest weight bits first, with the layers and weights it covers, counted from the safetensors
    headers), ``scheme`` names them all (``W4A16_ASYM+W8A16``) and ``bits``, ``group_size``, ``symmetric`` and
    ``strategy`` give one value per group in the same order (``4+8``), so the first group alone never stands for
    the whole model. ``bits_per_weight`` is the quantized layers' bits as their files store them (packed values,
    scales, zero points), what ``--target-bits`` and the manifest's ``measured_bits`` mean."""
    cfg_path = root / "config.json"
    hf_quant = root / "hf_quant_config.json"
    if hf_quant.exists():
        q = _obj(_config(hf_quant).get("quantization"))
        return {"format": "modelopt", "scheme": q.get("quant_algo"), "kv_cache": q.get("kv_cache_quant_algo")}
    if not cfg_path.exists():
        return {"format": "unknown"}
    cfg = _config(cfg_path)
    if "quantization" in cfg and "architecture" in cfg:  # TensorRT-LLM checkpoint config
        q = _obj(cfg["quantization"])
        return {"format": "trtllm-checkpoint", "scheme": q.get("quant_algo"), "kv_cache": q.get("kv_cache_quant_algo")}
    q = quantization_config(cfg)
    if not q:
        return {"format": "hf", "dtype": cfg.get("dtype") or cfg.get("torch_dtype")}
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(root, q)
    return _legacy(root, q, str(method))


def _compressed_tensors(root: Path, q: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config``: every config group, and the summary of them all."""
    groups = sorted((_ct_group(name, _obj(g)) for name, g in _obj(q.get("config_groups")).items()),
                    key=lambda g: (g["bits"] if isinstance(g["bits"], int) else 99, g["name"]))
    layers = _quantized_layers(root)
    _count_groups(groups, layers)
    info: dict[str, Any] = {"format": "compressed-tensors", "ct_format": q.get("format"),
                            "scheme": "+".join(g["scheme"] for g in groups) or None}
    for key in ("bits", "type", "group_size", "symmetric", "strategy", "activations"):
        info[key] = _joined([g[key] for g in groups])
    info.update(ignore=q.get("ignore"), kv_cache=q.get("kv_cache_scheme"), compressed_tensors_version=q.get("version"),
                groups=groups, bits_per_weight=_bits(layers))
    return info


def _ct_group(name: str, group: dict[str, Any]) -> dict[str, Any]:
    """One compressed-tensors config group as ``inspect`` shows it."""
    w, a = _obj(group.get("weights")), _obj(group.get("input_activations"))
    return {"name": name, "scheme": _ct_scheme(w, a), "bits": w.get("num_bits"), "type": w.get("type"),
            "group_size": w.get("group_size"), "symmetric": w.get("symmetric"), "strategy": w.get("strategy"),
            "activations": f"{a.get('type')}{a.get('num_bits')} {a.get('strategy')} "
                           f"{'dynamic' if a.get('dynamic') else 'static'}" if a else None,
            "format": group.get("format"), "targets": [t for t in group.get("targets") or [] if isinstance(t, str)]}


def _ct_scheme(w: dict[str, Any], a: dict[str, Any]) -> str:
    """A config group's scheme under compressed-tensors' preset names (``W4A16_ASYM``, ``NVFP4A16``, ``FP8_DYNAMIC``),
    which are the names quantkit's manifests record."""
    bits, wtype = w.get("num_bits"), w.get("type")
    if wtype == "float" and bits == 4:
        fp4 = {16: "NVFP4", 32: "MXFP4"}.get(w.get("group_size"), "FP4")
        return fp4 if a else f"{fp4}A16"
    if wtype == "float" and bits == 8:
        if not a:
            return "FP8A16"
        return "FP8_BLOCK" if w.get("strategy") == "block" else "FP8_DYNAMIC" if a.get("dynamic") else "FP8"
    acts = "16" if not a else "FP8" if (a.get("type"), a.get("num_bits")) == ("float", 8) else str(a.get("num_bits"))
    return f"W{bits}A{acts}" + ("_ASYM" if w.get("symmetric") is False else "")


def _joined(values: list[Any]) -> Any:
    """One value for all groups: the value where they agree (or there is one), else each group's, ``+``-joined."""
    if len(set(map(str, values))) <= 1:
        return values[0] if values else None
    return "+".join("none" if v is None else str(v) for v in values)


def _legacy(root: Path, q: dict[str, Any], method: str) -> dict[str, Any]:
    """An AutoGPTQ / AutoAWQ / other layout's ``quantization_config`` (or ``quantize_config.json``): bits, group
    size and symmetry under their own names (GPTQ ``sym``, AWQ ``zero_point``), named as a scheme like the rest."""
    bits = q.get("bits") or q.get("w_bit")
    group = q.get("group_size") or q.get("q_group_size")
    symmetric = q["sym"] if isinstance(q.get("sym"), bool) else \
        (not q["zero_point"]) if isinstance(q.get("zero_point"), bool) else None
    scheme = f"W{bits}A16" + ("_ASYM" if symmetric is False else "") if isinstance(bits, int) else None
    info = {"format": method, "scheme": scheme, "bits": bits, "group_size": group, "symmetric": symmetric,
            "bits_per_weight": _bits(_quantized_layers(root, bits if isinstance(bits, int) else None))}
    if "desc_act" in q:
        info["strategy"] = "group, act-order" if q["desc_act"] else "group"
    return info


# ---------------------------------------------------------------------------------------------------------------
# The quantized layers as their files store them (safetensors headers, no tensor data but a weight_shape's 2 ints)

def _quantized_layers(root: Path, legacy_bits: int | None = None) -> dict[str, tuple[int, int]]:
    """Each quantized module's weights and stored bytes, read from the safetensors headers: a compressed-tensors
    module (one with a ``weight_scale``) counts its ``weight*`` tensors (packed values, scales, zero points, global
    scale: :func:`quantkit.source.stored_weight_tensor`, as :func:`quantkit.producers.mixed.measured_bits` does); a
    GPTQ/AWQ one (``qweight``) its ``qweight``, ``scales``, ``qzeros`` and ``g_idx``. {} when a file's header is
    unreadable: inspect still says what the configs say, and the seal check says what is wrong with the file."""
    out: dict[str, tuple[int, int]] = {}
    for path in sorted(root.glob("*.safetensors")):
        try:
            header, data_len = safetensors_header(path)
            modules: dict[str, dict[str, dict[str, Any]]] = {}
            for name, entry in header.items():
                module, _, tensor = name.rpartition(".")
                if isinstance(entry, dict) and module:
                    modules.setdefault(module, {})[tensor] = entry
            shapes = shapes_before_packing({path: (header, data_len)})
            for module, tensors in modules.items():
                found = _layer(tensors, shapes.get(module), legacy_bits)
                if found:
                    out[module] = found
        except (QuantkitError, OSError, KeyError, TypeError, ValueError):
            return {}
    return out


def _layer(tensors: dict[str, dict[str, Any]], before_packing: int | None, legacy_bits: int | None
           ) -> tuple[int, int] | None:
    """(weights, stored bytes) of one module's tensors, or None when it is not quantized; ``before_packing`` is its
    weight count from its ``weight_shape`` (:func:`quantkit.source.shapes_before_packing`), where it has one."""
    def nbytes(names: list[str]) -> int:
        return sum(tensors[n]["data_offsets"][1] - tensors[n]["data_offsets"][0] for n in names)

    def numel(name: str) -> int:
        return math.prod(tensors[name]["shape"])

    if "weight_scale" in tensors:
        stored = nbytes([n for n in tensors if stored_weight_tensor(n)])
        if before_packing is not None:  # packed ints
            return before_packing, stored
        if "weight" in tensors:
            return numel("weight"), stored
        if "weight_packed" in tensors:  # FP4: two e2m1 values a byte
            return numel("weight_packed") * 2, stored
        return None
    if "qweight" in tensors and legacy_bits:
        packed = _DTYPE_BITS.get(tensors["qweight"].get("dtype"), 32)
        return numel("qweight") * packed // legacy_bits, nbytes([n for n in ("qweight", "scales", "qzeros", "g_idx")
                                                                 if n in tensors])
    return None


_DTYPE_BITS = {"I32": 32, "U32": 32, "I16": 16, "U8": 8, "I8": 8, "I64": 64}


def _bits(layers: dict[str, tuple[int, int]]) -> float | None:
    """Bits per weight of the quantized layers: their stored bytes over their weights."""
    weights = sum(w for w, _ in layers.values())
    return round(8 * sum(b for _, b in layers.values()) / weights, 4) if weights else None


def _count_groups(groups: list[dict[str, Any]], layers: dict[str, tuple[int, int]]) -> None:
    """Add each group's ``layers``, ``weights`` and ``share`` of the quantized weights: a module belongs to the
    group whose ``re:`` target matches its name, else to the group that targets a class (``Linear``), as
    compressed-tensors assigns them. Nothing is added when the headers gave no quantized module."""
    if not layers:
        return
    by_regex = [(g, [t[3:] for t in g["targets"] if t.startswith("re:")]) for g in groups]
    catch_all = next((g for g in groups if any(not t.startswith("re:") for t in g["targets"])), None)
    if catch_all is None and len(groups) == 1:
        catch_all = groups[0]
    for g in groups:
        g.update(layers=0, weights=0)
    total = sum(w for w, _ in layers.values())
    for module, (weights, _) in layers.items():
        home = next((g for g, pats in by_regex if any(_matches(p, module) for p in pats)), catch_all)
        if home is not None:
            home["layers"] += 1
            home["weights"] += weights
    for g in groups:
        g["share"] = round(g["weights"] / total, 4) if total else None


def _matches(pattern: str, name: str) -> bool:
    """Whether a ``re:`` target matches a module name (``re.match``, as compressed-tensors reads it); a pattern that
    is no regular expression matches nothing."""
    try:
        return re.match(pattern, name) is not None
    except re.error:
        return False


def describe_gguf_files(root: Path) -> list[dict[str, Any]]:
    """Each GGUF file's quantization type and size (``general.file_type`` read with gguf-py)."""
    out = []
    for f in gguf_files(root):
        info: dict[str, Any] = {"file": f.name, "size": f.stat().st_size}
        try:
            from gguf import GGUFReader, LlamaFileType

            r = GGUFReader(str(f))
            ft = r.fields.get("general.file_type")
            if ft is not None:
                info["type"] = LlamaFileType(int(ft.contents())).name.removeprefix("MOSTLY_")
            info["tensors"] = len(r.tensors)
        except Exception as e:  # an unreadable GGUF is reported, not fatal to inspect
            info["error"] = f"{type(e).__name__}: {e}"
        out.append(info)
    return out


def describe(path: Path) -> dict[str, Any]:
    """Everything ``inspect`` prints, as data: an artifact, a checkpoint, a ``.gguf`` file (checked against the
    manifest of its folder, where it has one), or a release folder: each of its artifacts, and the release as a
    whole against its ``SHA256SUMS`` (what ``verify`` checks)."""
    path = Path(path)
    if integrity.release_artifacts(path):
        *checks, release = integrity.verify_tree(path)
        return {"path": str(path), "release": release.to_json(), "artifacts": [_describe(c.root, c) for c in checks]}
    return _describe(path, None)


def _describe(path: Path, check: integrity.VerifyResult | None) -> dict[str, Any]:
    """One artifact, checkpoint or ``.gguf`` file; ``check``: its seal, already verified.

    Two figures of bits: ``bits_per_weight``, the quantized layers' (from the files' headers; else the manifest's
    ``quantization.mixed.measured_bits``), what ``--target-bits``, the manifest and docs/formats.md mean; and
    ``bits_per_parameter``, every weight file's bytes over the source's parameters (embeddings, norms and an
    unquantized lm_head included), the figure ``eval`` puts in its table."""
    refuse_special_files(path)  # what follows reads its configs, headers and manifest: none may block
    kind = kinds.detect(path)
    info: dict[str, Any] = {"path": str(path), "kind": kind.name, "size_bytes": size_bytes(path)}
    if kind.name == KindName.GGUF:
        info["format"] = "gguf"
        info["gguf"] = describe_gguf_files(path)
    elif path.is_dir():
        info.update(checkpoint_quantization(path))
    home = integrity.artifact_of(path)
    if home is not None:
        m = read_manifest(home)
        src = m.source
        info["method"] = m.method
        info["created"] = m.created
        info["quantkit_version"] = m.quantkit_version
        info["source"] = src.id
        info["source_size_bytes"] = src.size_bytes
        if kind.name != KindName.GGUF and isinstance(m.quantization.get("scheme"), str):
            info["scheme"] = m.quantization["scheme"]  # the name quantkit gave the mix, as the model card says it
        measured = _obj(m.quantization.get("mixed")).get("measured_bits")
        if info.get("bits_per_weight") is None and isinstance(measured, (int, float)):
            info["bits_per_weight"] = measured
        if src.size_bytes:
            info["compression"] = round(src.size_bytes / max(1, info["size_bytes"]), 2)
        if src.parameters:
            if kind.name == KindName.GGUF:
                for g in info["gguf"]:
                    g["bits_per_weight"] = round(8 * g["size"] / src.parameters, 2)
            elif info["size_bytes"]:
                info["bits_per_parameter"] = round(8 * info["size_bytes"] / src.parameters, 2)
        info["calibration"] = m.calibration.model_dump(mode="json") if m.calibration else None
        info["evaluation"] = m.evaluation.model_dump(mode="json") if m.evaluation else None
        info["smoke"] = m.smoke.model_dump(mode="json") if m.smoke else None
        if home == path:
            _legacy_copy(info, path, m)
        # the artifact itself, or one file or folder of it against its manifest: what `verify PATH` checks
        check = check or (integrity.verify(home) if home == path else integrity.verify_file(path))
        info["manifest"] = check.to_json()
    else:
        info["manifest"] = None
    unreadable = [g for g in info.get("gguf", []) if "error" in g]
    if unreadable and (info["manifest"] is None or info["manifest"]["ok"]):  # else the mismatch says why
        g = unreadable[0]  # a file that is not what it claims: exit 1, as doctor and eval say of it
        raise IntegrityError(f"{g['file']} is not a readable GGUF file: {g['error']}",
                             hint="re-create it (quantkit gguf ... --force)")
    return info


def _legacy_copy(info: dict[str, Any], root: Path, m: Manifest) -> None:
    """Add ``legacy_copy`` (its folder, the bytes of its weight files) for an artifact that also holds its weights
    in a legacy layout (``--format gptq``/``autoawq``): that second copy is left out of ``size_bytes``, so it is
    given apart, and the bytes on disk are all accounted for."""
    folder = _obj(m.quantization.get("legacy")).get("path")
    if m.legacy_bytes and isinstance(folder, str):
        info["legacy_copy"] = {"path": str(root / folder), "size_bytes": m.legacy_bytes}
