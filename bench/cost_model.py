"""What a quantization run costs on one GPU, estimated from its FLOPs before any GPU time is spent on it
(``python bench/quantize_cost.py --estimate``), so that a GPU run is planned, not guessed.

What is counted, per decoder layer and calibration sample of L tokens, following llm-compressor 0.14.0.1:

* the sequential pipeline runs every layer twice over every sample (calibration with the modifiers' hooks, then
  propagation of the quantized layer's outputs): 2 x (2 L x in x out per Linear + 2 L^2 x heads x head_dim for
  causal attention); with ``moe_calibrate_all_experts`` (its default) **every expert runs every token**, so an
  MoE layer costs all of its experts, not top-k of them;
* GPTQ adds a Hessian per quantized Linear, accumulated in float32 (``H += X^T X``: 2 L x in^2), and once per
  module the Cholesky factorisation and the column sweep (about in^3 + out x in^2, float32);
* the per-expert Python loop of llm-compressor's linearized experts (a ``torch.where`` that synchronises with
  the device, then a handful of kernels, and the calibration hooks of each expert's modules) costs a fixed time per
  expert, layer, sample and pass;
* the pipeline's own work per layer and sample beyond FLOPs (onloading the layer, hooks, caching its inputs);
* start-up (imports, CUDA), and loading and saving in proportion to the source's bytes.

The rates in :class:`Rates` are fitted (least squares on the relative error, the bf16 rate held) to the ten runs
measured on an H200 at 32 and 128 x 2048 tokens: the 8B shape's GPTQ and FP8 static (medians of three), the 32B
width with 8 layers, the 30B-A3B MoE width with 12 layers, the 70B width with 4 and 8 layers (GPTQ) and the 8B
at 128 samples. Each is predicted within -16% / +14% (``tests/test_bench_moe.py`` holds the committed results to
20%); before this fit the model gave 0.41-1.42 times what was measured. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shapes import Shape

MODELLED = ("gptq", "fp8-static")


@dataclass(frozen=True)
class Rates:
    """Achieved throughput and fixed costs on one H200 (assumptions, see the module docstring)."""

    bf16_flops: float = 400e12  # calibration forward GEMMs (H200 dense bf16 peak ~990e12; held, not fitted)
    fp32_flops: float = 30e12  # GPTQ Hessians and solves (H200 float32 peak ~67e12)
    expert_step_s: float = 0.94e-3  # one expert of the linearized MoE loop, its hooks included
    layer_sample_s: float = 0.013  # the sequential pipeline's own work per layer and calibration sample
    startup_s: float = 8.5  # interpreter, torch, transformers, llm-compressor imports, CUDA
    load_bytes_s: float = 1.4e9  # from the page cache to the device, layer by layer, per bf16 source byte
    save_bytes_s: float = 1.6e9  # compress (pack or cast) and write, per bf16 source byte


def linears(shape: Shape) -> list[tuple[str, int, int, int]]:
    """Per decoder layer: (name, in features, out features, copies) of every Linear quantization targets."""
    f = shape.config()
    h, heads, kv = f["hidden_size"], f["num_attention_heads"], f["num_key_value_heads"]
    hd = f.get("head_dim") or h // heads
    out = [("q_proj", h, heads * hd, 1), ("k_proj", h, kv * hd, 1), ("v_proj", h, kv * hd, 1),
           ("o_proj", heads * hd, h, 1)]
    if shape.moe:
        m, e = f["moe_intermediate_size"], f["num_experts"]
        return out + [("experts.gate_proj", h, m, e), ("experts.up_proj", h, m, e), ("experts.down_proj", m, h, e)]
    i = f["intermediate_size"]
    return out + [("gate_proj", h, i, 1), ("up_proj", h, i, 1), ("down_proj", i, h, 1)]


def parameters(shape: Shape) -> int:
    """Weights of the checkpoint (norms left out: they do not move the estimate)."""
    f = shape.config()
    per_layer = sum(i * o * n for _, i, o, n in linears(shape))
    if shape.moe:
        per_layer += f["hidden_size"] * f["num_experts"]  # the router
    embed = f["vocab_size"] * f["hidden_size"]
    return f["num_hidden_layers"] * per_layer + embed * (1 if f.get("tie_word_embeddings") else 2)


def _batch_bytes(lin: list[tuple[str, int, int, int]], i: int, o: int, block: int = 128) -> int:
    """GPU memory of one batched GPTQ solve: llm-compressor 0.14's ``max_batch_size`` per-module peak (float32)
    times every module of the layer with the same weight shape (with ~130 GB free, "auto" batches them all)."""
    count = sum(n for _, a, b, n in lin if (a, b) == (i, o))
    per_module = max(i * i + 3 * o * i + 4 * o * block, 3 * i * i + 2 * o * i) * 4
    return count * per_module


def estimate(shape: Shape, method: str, samples: int, seq_len: int, rates: Rates = Rates()) -> dict[str, Any]:
    """FLOPs and seconds of one run of ``method`` (``gptq`` or ``fp8-static``) through llm-compressor's
    sequential pipeline, and a rough peak of GPU memory (one layer on the device at a time)."""
    if method not in MODELLED:
        raise ValueError(f"no cost model for {method!r}; modelled: {', '.join(MODELLED)}")
    f = shape.config()
    layers, L = f["num_hidden_layers"], seq_len
    heads, hd = f["num_attention_heads"], f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"]
    lin = linears(shape)
    forward = layers * samples * 2 * (2 * L * sum(i * o * n for _, i, o, n in lin) + 2 * L * L * heads * hd)
    experts = f.get("num_experts", 0)
    loop_s = layers * samples * 2 * experts * rates.expert_step_s
    hessian = solve = 0
    if method == "gptq":
        hessian = layers * samples * sum(2 * L * i * i * n for _, i, _, n in lin)
        solve = layers * sum((i ** 3 + o * i * i) * n for _, i, o, n in lin)
    source_bytes = 2 * parameters(shape)
    fixed = rates.startup_s + source_bytes / rates.load_bytes_s + source_bytes / rates.save_bytes_s
    compute = forward / rates.bf16_flops + (hessian + solve) / rates.fp32_flops + loop_s \
        + layers * samples * rates.layer_sample_s
    layer_bytes = 2 * sum(i * o * n for _, i, o, n in lin)
    hessian_bytes = sum(4 * i * i * n for _, i, _, n in lin) if method == "gptq" else 0
    batch_bytes = max(_batch_bytes(lin, i, o) for _, i, o, _ in lin) if method == "gptq" else 0
    return {"method": method, "samples": samples, "seq_len": seq_len, "forward_flops": forward,
            "hessian_flops": hessian, "solve_flops": solve, "expert_loop_s": round(loop_s, 1),
            "compute_s": round(compute, 1), "fixed_s": round(fixed, 1), "wall_s": round(compute + fixed, 1),
            "peak_gpu_bytes": layer_bytes + hessian_bytes + batch_bytes, "host_bytes": source_bytes,
            "rates": rates.__dict__}


def markdown(shape_name: str, shape: Shape, rows: list[dict[str, Any]]) -> str:
    """The estimates as a table, with the assumptions beside it."""
    r = rows[0]["rates"]
    lines = [f"Estimate for `{shape_name}` ({shape.architecture}, {parameters(shape) / 1e9:.2f}B parameters) on one "
             f"H200, per tool (quantkit's CLI and the direct script cost the same work):", "",
             "| method | tokens | forward PFLOP (bf16) | Hessian + solve PFLOP (fp32) | expert loop | "
             "compute and pipeline | start-up + load + save | wall | peak GPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['method']} | {x['samples']} x {x['seq_len']} | {x['forward_flops'] / 1e15:.2f} | "
                     f"{(x['hessian_flops'] + x['solve_flops']) / 1e15:.2f} | {x['expert_loop_s']:.0f} s | "
                     f"{x['compute_s']:.0f} s | {x['fixed_s']:.0f} s | **{x['wall_s'] / 60:.1f} min** | "
                     f"~{x['peak_gpu_bytes'] / 2**30:.0f} GiB |")
    lines += ["", f"Assumed: bf16 GEMMs at {r['bf16_flops'] / 1e12:.0f} TFLOP/s, float32 at "
              f"{r['fp32_flops'] / 1e12:.0f} TFLOP/s, {r['expert_step_s'] * 1e6:.0f} us per expert step, "
              f"{r['layer_sample_s'] * 1e3:.0f} ms per layer and sample, start-up "
              f"{r['startup_s']:.0f} s, load {r['load_bytes_s'] / 1e9:.1f} GB/s, save {r['save_bytes_s'] / 1e9:.1f} "
              "GB/s of bf16 source. Peak GPU: one layer's weights, its Hessians and its largest batched GPTQ solve, "
              "a floor "
              "(the allocator's cache and activation buffers are not counted: 4.6 GiB here for the 8B GPTQ run that "
              "peaked at 10.4 GiB).", ""]
    return "\n".join(lines)
