"""Benchmark: HF -> GGUF conversion time and memory, quantkit vs llama.cpp's own convert_hf_to_gguf.py.

    python bench/gguf_convert.py                      # quick: a small Llama-shaped checkpoint
    python bench/gguf_convert.py --shape 1b           # Llama-3.2-1B shape (2.5 GB of bf16)
    python bench/gguf_convert.py --shape 8b           # Llama-3.1-8B shape (16 GB; ~50 GB of disk in all)

A checkpoint of the chosen shape is written with random bf16 weights, shard by shard (memory stays around one
shard), with a small SentencePiece tokenizer that both converters accept (vocabulary padded to the config's
size). Each converter then runs in its own process writing an F16 (or --outtype) GGUF, and its wall time and
peak memory are measured: peak RSS (``ru_maxrss``, which also counts the pages of the memory-mapped checkpoint
the process touched) and peak anonymous RSS (sampled from /proc, the memory the process really allocated).
The two files are then compared tensor by tensor (names, shapes, types and bytes).

llama.cpp's script is run from the llama-cpp-python source distribution (``--llamacpp``), for comparison only.
Needs torch, safetensors, gguf, sentencepiece and protobuf (the ``gguf`` extra). Results go to
bench/results/gguf_convert.json (one entry per shape, updated in place) and .md.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import LLAMA  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_LLAMACPP = Path("/tmp/lcpp_x/llama_cpp_python-0.3.36/vendor/llama.cpp")

SHARD_BYTES = 2 << 30


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint of this config, in the order Hugging Face writes them."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def write_checkpoint(path: Path, shape: str) -> dict:
    """config.json, random bf16 shards generated and written one at a time, their index, and a tokenizer."""
    import torch
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "bfloat16", **LLAMA[shape].fields}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shp in tensor_shapes(cfg):
        nbytes = 2 * math.prod(shp)
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shp))
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: torch.ones(shp, dtype=torch.bfloat16) if name.endswith("norm.weight") else
                 torch.empty(shp, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen) for name, shp in group}
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        del shard
    total = sum(2 * math.prod(s) for _, s in tensor_shapes(cfg))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_tokenizer(path)
    return cfg


def write_tokenizer(path: Path) -> None:
    """A small SentencePiece BPE (Llama 2 style): accepted by both converters, padded to the config's vocab."""
    import sentencepiece as spm

    with gzip.open(ROOT / "calibration" / "prose.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()][:120]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=2000, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, minloglevel=2,
        max_sentence_length=1 << 20, normalization_rule_name="identity", remove_extra_whitespaces=False)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True}))


_MEASURE = r"""
import json, os, resource, subprocess, sys, time
cmd = json.loads(sys.argv[1])
t0 = time.perf_counter()
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
peak_anon = 0
def sample():
    global peak_anon
    try:
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    peak_anon = max(peak_anon, int(line.split()[1]) * 1024)
    except OSError:
        pass
import threading
done = threading.Event()
def watch():
    while not done.is_set():
        sample()
        time.sleep(0.1)
threading.Thread(target=watch, daemon=True).start()
out = p.communicate()[0]
done.set()
wall = time.perf_counter() - t0
print(json.dumps({"rc": p.returncode, "wall_s": round(wall, 2),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "peak_anon_rss_bytes": peak_anon, "tail": out[-2000:]}))
"""


def measure(cmd: list[str], env: dict[str, str]) -> dict:
    """Run ``cmd`` under a fresh wrapper process so ru_maxrss covers that one command only."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(cmd)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(a: Path, b: Path) -> dict:
    """Tensor-by-tensor comparison of two GGUF files (names, shapes, types, bytes)."""
    import gguf
    import numpy as np

    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    same_bytes = [n for n in ta if n in tb and ta[n].tensor_type == tb[n].tensor_type
                  and list(ta[n].shape) == list(tb[n].shape) and np.array_equal(ta[n].data, tb[n].data)]
    differing = sorted(n for n in set(ta) & set(tb) if n not in same_bytes)
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    diff = {n: float(np.abs(ta[n].data.astype(np.float64) - tb[n].data.astype(np.float64)).max()) for n in differing
            if ta[n].tensor_type in floats and ta[n].tensor_type == tb[n].tensor_type}
    return {"tensors_quantkit": len(ta), "tensors_llamacpp": len(tb), "identical": len(same_bytes),
            "only_in_quantkit": sorted(set(ta) - set(tb)), "only_in_llamacpp": sorted(set(tb) - set(ta)),
            "differing": differing, "max_abs_diff": diff}


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def write_markdown(results: dict) -> None:
    lines = ["# HF -> GGUF conversion: quantkit vs llama.cpp convert_hf_to_gguf.py", "",
             "Random-weight Llama-shaped bf16 checkpoints, converted to one GGUF each, one process per run "
             "(`python bench/gguf_convert.py --shape SHAPE`). Peak RSS counts the touched pages of the memory-mapped "
             "checkpoint too; peak anonymous RSS is the memory each converter itself allocated.", "",
             "| shape | params | checkpoint | type | converter | wall | peak RSS | peak anon RSS | output |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape, r in results.items():
        for who in ("quantkit", "llama.cpp"):
            m = r["runs"].get(who)
            if not m:
                continue
            extra = f" (convert step {m['convert_s']:.1f}s)" if m.get("convert_s") else ""
            lines.append(f"| {shape} | {r['parameters'] / 1e9:.2f}B | {gib(r['checkpoint_bytes'])} | {r['outtype']} | "
                         f"{who} | {m['wall_s']:.1f}s{extra} | {gib(m['peak_rss_bytes'])} | "
                         f"{gib(m['peak_anon_rss_bytes'])} | {gib(m.get('output_bytes', 0))} |")
    lines += ["", "Tensor-by-tensor comparison of the two files:", ""]
    for shape, r in results.items():
        c = r.get("comparison")
        if c:
            lines.append(f"- {shape}: {c['identical']} of {c['tensors_quantkit']} tensors identical in name, shape, "
                         f"type and bytes; only in quantkit: {c['only_in_quantkit'] or 'none'}; only in llama.cpp: "
                         f"{c['only_in_llamacpp'] or 'none'}; differing: {c['differing'] or 'none'}"
                         + (f" (max abs difference {c['max_abs_diff']})" if c.get("max_abs_diff") else ""))
    lines += ["", "`rope_freqs.weight` (Llama 3.1's rope scaling factors, computed from the config rather than read) "
              "differs only in float32 rounding of the same formula.", "",
              f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, shared with other "
              "jobs while measured, so wall times carry noise of tens of percent; memory figures do not. quantkit's "
              "wall time includes its source checks and the sha256 manifest of the output; 'convert step' is the "
              "conversion itself."]
    (RESULTS / "gguf_convert.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(LLAMA), default="small")
    ap.add_argument("--outtype", choices=["f16", "bf16", "q8_0"], default="f16")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-gguf"))
    ap.add_argument("--llamacpp", type=Path, default=DEFAULT_LLAMACPP,
                    help="llama.cpp source folder holding convert_hf_to_gguf.py")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = ap.parse_args()

    work = args.workdir / args.shape
    if work.exists():
        shutil.rmtree(work)
    ckpt = work / "checkpoint"
    t0 = time.perf_counter()
    cfg = write_checkpoint(ckpt, args.shape)
    print(f"checkpoint written in {time.perf_counter() - t0:.0f}s: {ckpt}", flush=True)
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    params = sum(math.prod(s) for _, s in tensor_shapes(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t = args.outtype.upper()
    runs: dict[str, dict] = {}

    q_out = work / "quantkit"
    runs["quantkit"] = measure([sys.executable, "-m", "quantkit", "-q", "gguf", str(ckpt), str(q_out), "-t", t,
                                "--json"], env)
    q_file = q_out / f"checkpoint-{t}.gguf"
    if runs["quantkit"]["rc"] == 0:
        manifest = json.loads((q_out / "quantkit.json").read_text())
        runs["quantkit"]["convert_s"] = manifest["timings"].get(f"convert_{t}")
        runs["quantkit"]["output_bytes"] = q_file.stat().st_size
    print("quantkit:", {k: v for k, v in runs["quantkit"].items() if k != "tail"}, flush=True)

    l_file = work / "llamacpp" / f"checkpoint-{t}.gguf"
    l_file.parent.mkdir(parents=True)
    runs["llama.cpp"] = measure([sys.executable, str(args.llamacpp / "convert_hf_to_gguf.py"), str(ckpt),
                                 "--outfile", str(l_file), "--outtype", args.outtype], env)
    if runs["llama.cpp"]["rc"] == 0:
        runs["llama.cpp"]["output_bytes"] = l_file.stat().st_size
    print("llama.cpp:", {k: v for k, v in runs["llama.cpp"].items() if k != "tail"}, flush=True)

    result = {"shape": args.shape, "config": cfg, "parameters": params, "checkpoint_bytes": ckpt_bytes,
              "outtype": t, "runs": runs, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    if all(r["rc"] == 0 for r in runs.values()):
        result["comparison"] = compare(q_file, l_file)
        print("comparison:", result["comparison"], flush=True)
    for r in runs.values():
        if r["rc"] != 0:
            print(r["tail"], file=sys.stderr)
        r.pop("tail", None)

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "gguf_convert.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[args.shape] = result
    path.write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results)
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
