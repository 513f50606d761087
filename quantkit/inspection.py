"""``quantkit inspect``: say what an artifact is, from its files, and check its seal.

Works on quantkit artifacts (manifest + sha256 check; a ``.gguf`` file inside one against its folder's manifest; a
release folder artifact by artifact, then against its ``SHA256SUMS``) and on foreign ones too (a compressed-tensors,
AutoAWQ, GPTQ or ModelOpt checkpoint, a plain checkpoint, a ``.gguf`` file), reading only headers and configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit import artifact
from quantkit.checkpoint import gguf_files, quantization_config
from quantkit.errors import IntegrityError
from quantkit.formats import kinds
from quantkit.formats.names import KindName
from quantkit.source import MAX_CONFIG_BYTES


def _config(path: Path) -> dict[str, Any]:
    """A JSON config as a dict; a file that is not one is an :class:`IntegrityError` (exit 1) saying so."""
    try:
        raw = artifact.read_capped(path, MAX_CONFIG_BYTES)
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
    """Format, bits and scheme of a Hugging Face checkpoint folder, from its config files."""
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
        groups = _obj(q.get("config_groups"))
        g = _obj(next(iter(groups.values()), {}))
        w = _obj(g.get("weights"))
        a = _obj(g.get("input_activations"))
        scheme = f"W{w.get('num_bits')}A{a.get('num_bits', 16) if a else 16}"
        return {"format": "compressed-tensors", "ct_format": q.get("format"), "scheme": scheme,
                "bits": w.get("num_bits"), "type": w.get("type"), "strategy": w.get("strategy"),
                "group_size": w.get("group_size"), "symmetric": w.get("symmetric"),
                "activations": (a.get("type"), a.get("strategy"), "dynamic" if a.get("dynamic") else "static")
                if a else None, "ignore": q.get("ignore"), "kv_cache": q.get("kv_cache_scheme"),
                "compressed_tensors_version": q.get("version")}
    return {"format": str(method), "bits": q.get("bits") or q.get("w_bit"),
            "group_size": q.get("group_size") or q.get("q_group_size"), "scheme": q.get("version") or q.get("desc_act")}


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
    if artifact.release_artifacts(path):
        *checks, release = artifact.verify_tree(path)
        return {"path": str(path), "release": release.to_json(), "artifacts": [_describe(c.root, c) for c in checks]}
    return _describe(path, None)


def _describe(path: Path, check: artifact.VerifyResult | None) -> dict[str, Any]:
    """One artifact, checkpoint or ``.gguf`` file; ``check``: its seal, already verified."""
    kind = kinds.detect(path)
    info: dict[str, Any] = {"path": str(path), "kind": kind.name, "size_bytes": artifact.size_bytes(path)}
    if kind.name == KindName.GGUF:
        info["format"] = "gguf"
        info["gguf"] = describe_gguf_files(path)
    elif path.is_dir():
        info.update(checkpoint_quantization(path))
    home = artifact.artifact_of(path)
    if home is not None:
        m = artifact.read_manifest(home)
        src = m.source
        info["method"] = m.method
        info["created"] = m.created
        info["quantkit_version"] = m.quantkit_version
        info["source"] = src.id
        info["source_size_bytes"] = src.size_bytes
        if src.size_bytes:
            info["compression"] = round(src.size_bytes / max(1, info["size_bytes"]), 2)
        if src.parameters:
            if kind.name == KindName.GGUF:
                for g in info["gguf"]:
                    g["bits_per_weight"] = round(8 * g["size"] / src.parameters, 2)
            elif info["size_bytes"]:
                info["bits_per_weight"] = round(8 * info["size_bytes"] / src.parameters, 2)
        info["calibration"] = m.calibration.model_dump(mode="json") if m.calibration else None
        info["evaluation"] = m.evaluation.model_dump(mode="json") if m.evaluation else None
        info["smoke"] = m.smoke.model_dump(mode="json") if m.smoke else None
        check = check or (artifact.verify_file(path) if path.is_file() else artifact.verify(home))
        info["manifest"] = check.to_json()
    else:
        info["manifest"] = None
    unreadable = [g for g in info.get("gguf", []) if "error" in g]
    if unreadable and (info["manifest"] is None or info["manifest"]["ok"]):  # else the mismatch says why
        g = unreadable[0]  # a file that is not what it claims: exit 1, as doctor and eval say of it
        raise IntegrityError(f"{g['file']} is not a readable GGUF file: {g['error']}",
                             hint="re-create it (quantkit gguf ... --force)")
    return info
