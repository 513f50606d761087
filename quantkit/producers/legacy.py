"""Legacy checkpoint layouts: AutoAWQ GEMM (``quant_method: awq``) and GPTQ (``quant_method: gptq``).

TGI, older vLLM releases and ExLlama read these layouts, not compressed-tensors. AutoAWQ and AutoGPTQ are
archived and AutoGPTQ does not import with transformers 5, so the layouts are written here by repacking the
integer weights, zero points and scales of our own compressed-tensors checkpoint: the same numbers, another
bit layout. Nothing is re-quantized, so a legacy copy dequantizes to exactly the compressed-tensors weights.

Layouts (both store unsigned codes q in [0, 2^bits) and dequantize as (q - zero) * scale):

* AutoAWQ GEMM (4-bit only): ``qweight`` int32 [in, out/8] packing 8 output columns per word in AutoAWQ's
  interleaved order (0, 2, 4, 6, 1, 3, 5, 7); ``qzeros`` int32 [in/group, out/8], same packing; ``scales``
  float16 [in/group, out].
* GPTQ (AutoGPTQ "gptq" v1 checkpoint format, 4 or 8 bits): ``qweight`` int32 [in*bits/32, out] packing
  consecutive input rows from the low bits up; ``qzeros`` int32 [groups, out*bits/32] packing consecutive output
  columns, storing zero - 1 (the v1 convention loaders undo by adding 1); ``scales`` float16 [groups, out];
  ``g_idx`` int32 [in] (the group of each input column; from GPTQ's activation order when it was used).

Other tensors are written in float16, the dtype these engines run AWQ/GPTQ kernels in.

As a producer (:data:`PRODUCER`, the registry rows ``awq+autoawq`` and ``gptq+gptq``) it makes the
compressed-tensors artifact with :mod:`quantkit.producers.compressed`, then writes the legacy copy into a
subfolder named after the layout; the manifest's ``quantization.legacy`` describes it.

Tested with compressed-tensors 0.19.0 (reading) and against AutoAWQ 0.2.9's own packing code (tests).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError, UsageError
from quantkit.formats.specs import AwqSpec, GptqSpec
from quantkit.producers.base import ProduceContext, Produced
from quantkit.producers.compressed import PRODUCER as COMPRESSED
from quantkit.producers.groups import Checked
from quantkit.source import SourceModel

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: word slot i holds column AWQ_PACK_ORDER[i] of 8
FP16_MAX = 65504.0
_SKIP_FILES = ("config.json", "recipe.yaml", "quantkit.json", "model.safetensors.index.json")


@dataclass
class QuantizedLinear:
    """One quantized Linear, unpacked: unsigned codes, unsigned zero points, scales, group of each column."""

    codes: Any  # int32 [out, in], in [0, 2^bits)
    zeros: Any  # int32 [out, groups], in [0, 2^bits)
    scales: Any  # float [out, groups]
    g_idx: Any  # int32 [in]
    bits: int
    group_size: int  # -1: one group per output row
    bias: Any = None

    def dequantize(self) -> Any:
        """(code - zero) * scale for every weight, in float32 (what both layouts mean)."""
        import torch

        idx = self.g_idx.long()
        return (self.codes - self.zeros[:, idx]).to(torch.float32) * self.scales[:, idx].to(torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Packing (pure functions on int tensors; the tests compare them with AutoAWQ's code bit for bit)


def _to_int32(words: Any) -> Any:
    """int64 words holding 32-bit patterns -> int32 with the same bits (two's complement)."""
    import torch

    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(values: Any) -> Any:
    """AutoAWQ GEMM packing of 4-bit codes [rows, cols] -> int32 [rows, cols/8], interleaved column order."""
    import torch

    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(AWQ_PACK_ORDER)]
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return _to_int32((v << shifts).sum(-1))


def pack_gptq_rows(values: Any, bits: int) -> Any:
    """GPTQ qweight packing: codes [in, out] -> int32 [in*bits/32, out], consecutive rows from the low bits up."""
    import torch

    per = 32 // bits
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows // per, per, cols)
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    return _to_int32((v << shifts).sum(1))


def pack_gptq_cols(values: Any, bits: int) -> Any:
    """GPTQ qzeros packing: [groups, out] -> int32 [groups, out*bits/32], consecutive columns from the low bits."""
    import torch

    per = 32 // bits
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // per, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return _to_int32((v << shifts).sum(-1))


# ----------------------------------------------------------------------------------------------------------------
# Reading our compressed-tensors checkpoint


class _Checkpoint:
    """Lazy tensor access to a (possibly sharded) safetensors checkpoint."""

    def __init__(self, root: Path) -> None:
        from safetensors import safe_open

        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(root / "model.safetensors"), "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        self.root, self.weight_map = root, weight_map
        self._open: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.root / file), "pt")
        return self._open[file].get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map


def _weight_args(config: dict[str, Any]) -> dict[str, Any]:
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise UsageError("a legacy AWQ/GPTQ layout can only be made from a pack-quantized compressed-tensors "
                         f"checkpoint (got {qc.get('quant_method')}/{qc.get('format')})")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or not groups[0].get("weights"):
        raise UsageError("a legacy layout needs exactly one weight quantization scheme for every quantized layer")
    args = groups[0]["weights"]
    if args.get("type") != "int" or groups[0].get("input_activations"):
        raise UsageError("legacy AWQ/GPTQ layouts hold integer weight-only quantization")
    return args


def unpack(ckpt: _Checkpoint, prefix: str, args: dict[str, Any]) -> QuantizedLinear:
    """One compressed-tensors pack-quantized Linear -> unsigned codes, zero points, scales and g_idx."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    bits = int(args["num_bits"])
    offset = 1 << (bits - 1)  # compressed-tensors codes are signed: [-2^(b-1), 2^(b-1))
    shape = torch.Size(ckpt.get(f"{prefix}.weight_shape").tolist())
    out_f, in_f = shape
    codes = unpack_from_int32(ckpt.get(f"{prefix}.weight_packed"), bits, shape).to(torch.int32) + offset
    scales = ckpt.get(f"{prefix}.weight_scale")
    n_groups = scales.shape[-1]
    if f"{prefix}.weight_zero_point" in ckpt:
        zp = unpack_from_int32(ckpt.get(f"{prefix}.weight_zero_point"), bits, torch.Size((out_f, n_groups)),
                               packed_dim=0)
        zeros = zp.to(torch.int32) + offset
    else:
        zeros = torch.full((out_f, n_groups), offset, dtype=torch.int32)
    group_size = int(args.get("group_size") or -1) if args.get("strategy") == "group" else -1
    if f"{prefix}.weight_g_idx" in ckpt:
        g_idx = ckpt.get(f"{prefix}.weight_g_idx").to(torch.int32)
    elif group_size > 0:
        g_idx = torch.arange(in_f, dtype=torch.int32) // group_size
    else:
        g_idx = torch.zeros(in_f, dtype=torch.int32)
    bias = ckpt.get(f"{prefix}.bias") if f"{prefix}.bias" in ckpt else None
    return QuantizedLinear(codes, zeros, scales, g_idx, bits, group_size, bias)


def _fp16(name: str, t: Any) -> Any:
    import torch

    if not t.is_floating_point():
        return t
    if t.numel() and t.abs().max().item() > FP16_MAX:
        raise BackendError(f"{name} holds values beyond float16's range; the legacy layouts are float16",
                           hint="keep the compressed-tensors checkpoint (it stays in the model's dtype)")
    return t.to(torch.float16)


# ----------------------------------------------------------------------------------------------------------------
# Writing


def awq_tensors(prefix: str, q: QuantizedLinear) -> dict[str, Any]:
    """AutoAWQ GEMM tensors for one Linear."""
    import torch

    if q.bits != 4 or q.group_size <= 0:
        raise UsageError(f"{prefix}: AutoAWQ's GEMM layout holds int4 with a group size, not int{q.bits} "
                         f"group {q.group_size}")
    if not torch.equal(q.g_idx.long(), torch.arange(q.codes.shape[1]) // q.group_size):
        raise UsageError(f"{prefix}: AutoAWQ's GEMM layout has no activation-order permutation (g_idx)")
    if q.codes.shape[0] % 8:
        raise UsageError(f"{prefix}: {q.codes.shape[0]} output features are not a multiple of 8 (AWQ packing)")
    out = {f"{prefix}.qweight": pack_awq(q.codes.t().contiguous()),
           f"{prefix}.qzeros": pack_awq(q.zeros.t().contiguous()),
           f"{prefix}.scales": _fp16(f"{prefix}.scales", q.scales.t().contiguous())}
    if q.bias is not None:
        out[f"{prefix}.bias"] = _fp16(f"{prefix}.bias", q.bias)
    return out


def gptq_tensors(prefix: str, q: QuantizedLinear) -> dict[str, Any]:
    """GPTQ (v1 checkpoint format) tensors for one Linear."""
    import torch

    per = 32 // q.bits
    out_f, in_f = q.codes.shape
    if in_f % per or out_f % per:
        raise UsageError(f"{prefix}: {in_f}x{out_f} does not pack into int32 words of {per} {q.bits}-bit codes")
    if (q.zeros == 0).any():
        raise UsageError(f"{prefix}: a zero point of 0 cannot be stored in the GPTQ v1 layout (it stores zero - 1)",
                         hint="use --symmetric (the GPTQ default) for --format gptq")
    out = {f"{prefix}.qweight": pack_gptq_rows(q.codes.t().contiguous(), q.bits),
           f"{prefix}.qzeros": pack_gptq_cols((q.zeros - 1).t().contiguous(), q.bits),
           f"{prefix}.scales": _fp16(f"{prefix}.scales", q.scales.t().contiguous()),
           f"{prefix}.g_idx": q.g_idx.to(torch.int32)}
    if q.bias is not None:
        out[f"{prefix}.bias"] = _fp16(f"{prefix}.bias", q.bias)
    return out


def _block_modules(prefixes: list[str]) -> list[list[str]] | None:
    """GPTQ's ``modules_in_block_to_quantize``: the quantized Linear names inside a decoder block, when every block
    quantizes the same ones (so loaders leave the ignored ones, say ``mlp.down_proj``, in float16)."""
    import re

    per_block: dict[str, set[str]] = {}
    for p in prefixes:
        m = re.match(r"^(.*\.\d+)\.(.+)$", p)
        if m:
            per_block.setdefault(m.group(1), set()).add(m.group(2))
    sets = {frozenset(v) for v in per_block.values()}
    return [sorted(next(iter(sets)))] if len(sets) == 1 else None


def _legacy_config(fmt: str, args: dict[str, Any], qc: dict[str, Any], desc_act: bool,
                   prefixes: list[str]) -> dict[str, Any]:
    bits = int(args["num_bits"])
    group_size = int(args.get("group_size") or -1) if args.get("strategy") == "group" else -1
    not_converted = [n for n in qc.get("ignore", []) if not n.startswith("re:")] or None
    if fmt == "autoawq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": not_converted}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
            "sym": bool(args.get("symmetric", True)), "static_groups": False, "true_sequential": True,
            "checkpoint_format": "gptq", "model_file_base_name": "model",
            "modules_in_block_to_quantize": _block_modules(prefixes)}


def write(fmt: str, ct_dir: Path, out_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``ct_dir``'s compressed-tensors checkpoint into ``out_dir`` in a legacy layout (autoawq or gptq).

    ``extra`` adds informational keys to the legacy quantization config (GPTQ's ``damp_percent``).

    Returns the manifest's description of the copy. Output shards follow the source's shards, so memory stays
    at about one shard.
    """
    from safetensors.torch import save_file

    if fmt not in ("autoawq", "gptq"):
        raise UsageError(f"unknown legacy format {fmt!r} (autoawq or gptq)")
    config = json.loads((ct_dir / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    args = _weight_args(config)
    ckpt = _Checkpoint(ct_dir)
    prefixes = sorted(k.removesuffix(".weight_packed") for k in ckpt.weight_map if k.endswith(".weight_packed"))
    owned = {f"{p}.{s}" for p in prefixes
             for s in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "bias")}
    files: dict[str, list[str]] = {f: [] for f in dict.fromkeys(ckpt.weight_map.values())}
    for p in prefixes:
        files[ckpt.weight_map[f"{p}.weight_packed"]].append(p)
    out_dir.mkdir(parents=True, exist_ok=True)
    desc_act = False
    weight_map: dict[str, str] = {}
    total = 0
    to_tensors = awq_tensors if fmt == "autoawq" else gptq_tensors
    for file, mods in files.items():
        shard: dict[str, Any] = {}
        for p in mods:
            q = unpack(ckpt, p, args)
            desc_act = desc_act or f"{p}.weight_g_idx" in ckpt
            shard.update(to_tensors(p, q))
        for name, f in ckpt.weight_map.items():
            if f == file and name not in owned:
                shard[name] = _fp16(name, ckpt.get(name))
        save_file({k: v.contiguous() for k, v in shard.items()}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    if (ct_dir / "model.safetensors.index.json").exists():
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    legacy_qc = _legacy_config(fmt, args, qc, desc_act, prefixes)
    legacy_qc.update(extra or {})
    config["quantization_config"] = legacy_qc
    config["dtype"] = "float16"
    config.pop("torch_dtype", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "gptq":  # AutoGPTQ and ExLlama read this file; newer loaders read config.json
        (out_dir / "quantize_config.json").write_text(json.dumps(legacy_qc, indent=2) + "\n")
    for f in ct_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in _SKIP_FILES:
            shutil.copy2(f, out_dir / f.name)
    return {"format": fmt, **legacy_qc, "modules": len(prefixes), "dtype": "float16"}


# ----------------------------------------------------------------------------------------------------------------
# The producer: compressed-tensors first, then the legacy copy of the same weights


class LegacyProducer:
    """``--format autoawq`` and ``--format gptq``: the compressed-tensors artifact plus the legacy layout in a
    subfolder named after it (``autoawq/``, ``gptq/``)."""

    def check(self, spec: AwqSpec | GptqSpec, source: SourceModel) -> Checked:
        """The compressed-tensors producer's checks, then the layout's own; returns what they decided (carried to
        :meth:`produce`, which makes the compressed-tensors artifact first)."""
        checked = COMPRESSED.check(spec, source)
        choice = checked.choice
        if spec.format == "autoawq":
            if spec.bits != 4:
                raise UsageError(f"--format autoawq needs --bits 4 (AutoAWQ's GEMM layout packs only int4); got "
                                 f"--bits {spec.bits}", hint="drop --format autoawq, or use --bits 4")
            if choice.size <= 0:
                raise UsageError("--format autoawq needs a group size (AutoAWQ has no per-channel GEMM layout)",
                                 hint="use --group-size 128 (the AutoAWQ default) or drop --format autoawq")
        return checked

    def estimate_bytes(self, spec: AwqSpec | GptqSpec, source: SourceModel) -> int:
        return 2 * COMPRESSED.estimate_bytes(spec, source)  # the same weights twice

    def produce(self, ctx: ProduceContext) -> Produced:
        produced = COMPRESSED.produce(ctx)
        fmt = ctx.spec.format
        with ctx.reporter.step("legacy", f"Writing the legacy {fmt} layout into {fmt}/"):
            extra = {"damp_percent": ctx.spec.damp} if fmt == "gptq" else None
            described = write(fmt, ctx.workdir, ctx.workdir / fmt, extra)
        produced.quantization["legacy"] = {**described, "path": fmt}
        produced.notes.append(f"{fmt}/ holds the same weights in the legacy {fmt} layout "
                              f"(quant_method {described['quant_method']})")
        return produced


PRODUCER = LegacyProducer()
