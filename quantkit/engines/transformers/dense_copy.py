"""A dense copy of a weight-only compressed-tensors MoE checkpoint, for the transformers engine.

transformers 5.17 reloads a mixture-of-experts checkpoint by converting its per-expert tensors into fused 3-D expert
parameters, decompressing compressed-tensors experts on the way; that conversion hands the decompressor
``weight_packed``, ``weight_scale`` and ``weight_shape`` only, so asymmetric int4 experts (AWQ's default, RTN
``--asymmetric``) fail to load ("Asymmetric quant requires zero-point values"), while vLLM serves the same file.

For a weight-only scheme transformers itself runs the decompressed weights in dense matmuls, so scoring a dense copy
made by compressed-tensors' own decompressor gives the same figures by construction. Schemes that quantize
activations are never copied: their activations must stay quantized. transformers reloads FP8 experts, but not
int-quantized (INT8 W8A8) ones (its expert conversion finds no tensors to concatenate): :func:`refusal` says so
before anything loads, and vLLM scores them.

FP4 experts (NVFP4, MXFP4) are not reloaded either: transformers 5.17 leaves every expert tensor of the checkpoint
"UNEXPECTED" and the fused experts uninitialised, which scores without an error. They are copied dense too, W4A4
included: the copy runs weight-only (:mod:`quantkit.engines.numerics` says so), as vLLM does below Blackwell.

Tested with compressed-tensors 0.19.0 and transformers 5.17.0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from quantkit.checkpoint import fp4, quantization_config, read_config

_QUANTIZED = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
              "weight_global_scale")
_ACTIVATION_SCALES = ("input_global_scale",)  # an FP4 W4A4 checkpoint's: the dense copy runs weight-only
INDEX = "model.safetensors.index.json"


def needed(path: Path) -> bool:
    """Whether transformers needs a dense copy of ``path``: a mixture-of-experts compressed-tensors checkpoint whose
    weight-only scheme has zero points, or whose weights are FP4."""
    from quantkit.producers import moe

    cfg = read_config(path)
    qc = quantization_config(cfg)
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("quant_method") != "compressed-tensors" or not groups or moe.family(cfg) is None:
        return False
    if fp4(cfg) is not None:
        return True
    weight_only = all(not g.get("input_activations") for g in groups)
    return weight_only and any((g.get("weights") or {}).get("symmetric") is False for g in groups)


def refusal(path: Path) -> str | None:
    """Why transformers cannot score ``path`` at all (None when it can, maybe through a dense copy)."""
    from quantkit.producers import moe

    cfg = read_config(path)
    qc = quantization_config(cfg)
    formats = {qc.get("format"), *((g or {}).get("format") for g in (qc.get("config_groups") or {}).values())}
    if qc.get("quant_method") == "compressed-tensors" and "int-quantized" in formats and moe.family(cfg):
        return (f"{path} has int-quantized (INT8) mixture-of-experts weights, which transformers 5.17 cannot reload "
                "(its expert conversion finds none of them)")
    return None


def write(path: Path, dest: Path) -> Path:
    """Write the dense copy of ``path`` into ``dest`` (bf16/f16 weights as the scales are, no quantization config)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (group,) = qc["config_groups"].values()  # quantkit writes one scheme per checkpoint
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    dest.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors: dict[str, Any] = {}
        modules: dict[str, dict[str, Any]] = {}
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                prefix, _, leaf = key.rpartition(".")
                if leaf in _QUANTIZED:
                    modules.setdefault(prefix, {})[leaf] = f.get_tensor(key)
                elif leaf not in _ACTIVATION_SCALES:
                    tensors[key] = f.get_tensor(key)
        for prefix, local in modules.items():
            weight = compressor.decompress(local, scheme)["weight"]
            scale = local["weight_scale"].dtype  # the model's dtype, except FP4's FP8 / E8M0 scales
            tensors[f"{prefix}.weight"] = weight.to(scale if scale.is_floating_point and scale.itemsize > 1
                                                    else weight.dtype)
        save_file(tensors, str(dest / shard.name), metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in tensors})
    for f in path.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", INDEX):
            shutil.copy2(f, dest / f.name)
    if (path / INDEX).exists():
        (dest / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest
