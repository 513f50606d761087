"""The MoE side of the benchmarks on this CPU (issue 14 item 4), with the real code and no GPU: the shapes and the
random checkpoint they build, bench/quantize_cost.py end to end on the tiny MoE shape (quantkit's CLI and
llm-compressor directly), the bytes a decode step reads (bench/step_bytes.py) and bench/serve_speed.py's rows when
vLLM is absent, and the FLOP cost model. No timing is asserted: timings are what the benchmarks measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import cost_model  # noqa: E402
import quantize_cost  # noqa: E402
import serve_speed  # noqa: E402
import step_bytes  # noqa: E402
from shapes import LLAMA, SHAPES  # noqa: E402

pytestmark = pytest.mark.cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """quantize_cost's work folder with the moe-tiny checkpoint built by its own make_checkpoint."""
    work = tmp_path_factory.mktemp("qcost")
    quantize_cost.make_checkpoint("moe-tiny", work / "src-moe-tiny")
    return work


# ------------------------------------------------------------------------------------------------------------------
# Shapes


def test_shapes_carry_their_architecture() -> None:
    moe = SHAPES["qwen3-30b-a3b-12l"]
    cfg = moe.config()
    assert moe.moe and cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    # Qwen3-30B-A3B's published width, vocabulary and rope, with 12 of its 48 layers
    assert {k: cfg[k] for k in ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                                "vocab_size", "rope_theta", "max_position_embeddings", "norm_topk_prob")} == {
        "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 12,
        "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "norm_topk_prob": True}
    assert not SHAPES["8b"].moe and SHAPES["8b"].config()["architectures"] == ["LlamaForCausalLM"]
    # what gguf_convert.py offers
    assert set(LLAMA) == {"tiny", "small", "1b", "3b", "8b", "70b", "70b-4l", "70b-8l"}
    assert SHAPES["405b"].projected and "405b" not in LLAMA  # bench/project.py's target, never built


def test_moe_tiny_builds_and_loads_in_transformers(workdir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    src = workdir / "src-moe-tiny"
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts_per_tok"] == 2
    model, info = AutoModelForCausalLM.from_pretrained(src, dtype="auto", output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and not info["missing_keys"]
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 512, 256)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 8192) and torch.isfinite(logits).all()
    # rebuilt only when the config changes
    stamp = (src / "bench-config.json").stat().st_mtime_ns
    quantize_cost.make_checkpoint("moe-tiny", src)
    assert (src / "bench-config.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("build", ["quantize_cost.make_checkpoint", "wide.build"])
def test_a_source_built_by_one_invocation_is_reused_by_the_next(build: str, tmp_path: Path) -> None:
    """The tiny shape (a Llama with rope scaling) built twice into one folder, each time in a process of its own as
    each invocation of a benchmark is: the second finds the first's stamp equal to its fresh config and leaves the
    weights alone (same inode, same mtime). transformers 5 writes ``rope_theta`` into the ``rope_scaling`` dict it
    is given; when that dict was the shape table's or the stamp's own, every invocation rebuilt the source, and the
    new inodes made quantkit re-hash it inside the timed run."""
    module = build.split(".")[0]
    code = f"import sys; from pathlib import Path; import {module}; {build}('tiny', Path(sys.argv[1]))"
    src = tmp_path / "src"

    def invocation() -> dict[str, tuple[int, int]]:
        env = {**ENV, "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)])}
        p = subprocess.run([sys.executable, "-c", code, str(src)], cwd=BENCH, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in src.glob("*.safetensors")}

    first = invocation()
    assert first and invocation() == first
    assert "rope_theta" not in json.loads((src / "bench-config.json").read_text())["rope_scaling"]


# ------------------------------------------------------------------------------------------------------------------
# quantize_cost.py end to end


@pytest.mark.slow
def test_quantize_cost_moe_tiny_end_to_end(workdir: Path, tmp_path: Path) -> None:
    """Both tools quantize the tiny MoE with GPTQ and FP8 on the same tokens; every expert comes out quantized and
    the router stays in bf16; the results are written with their provenance."""
    results = tmp_path / "results"
    p = subprocess.run([sys.executable, str(BENCH / "quantize_cost.py"), "--shape", "moe-tiny", "--samples", "4",
                        "--seq-len", "64", "--workdir", str(workdir), "--results-dir", str(results), "--keep"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((results / "quantize_cost_moe-tiny.json").read_text())
    assert data["architecture"] == "Qwen3MoeForCausalLM" and list(data["runs"]) == ["gptq", "fp8-static"]
    for method, runs in data["runs"].items():
        q, d = runs["quantkit"], runs["llm-compressor"]
        assert q["rc"] == 0 and d["rc"] == 0, (method, q.get("error"), d.get("error"))
        assert q["same_tokens_as_direct"] and q["calibration_tokens_sha256"] == data["tokens_sha256"]
        assert d["load"].startswith(("load_context", "from_pretrained + linearize_moe"))
        # each tool's steps, so a difference in wall time can be traced to one
        assert {"start", "imports", "load", "oneshot", "save"} == set(d["timings"]) and d["timings"]["start"] >= 0
        assert sum(d["timings"].values()) <= d["wall_s"] and {"setup", "quantize", "save"} <= set(q["timings"])
        for tool in ("quantkit", "llm-compressor"):
            out = workdir / f"out-{tool}-{method}"
            qc = json.loads((out / "config.json").read_text())["quantization_config"]
            assert "model.layers.0.mlp.gate" in qc["ignore"] and "lm_head" in qc["ignore"]
            names = set().union(*(step_bytes.safetensors_header(f)[0] for f in out.glob("*.safetensors")))
            weight = "weight_packed" if method == "gptq" else "weight_scale"
            assert all(f"model.layers.{i}.mlp.experts.{e}.{proj}.{weight}" in names
                       for i in range(2) for e in range(8) for proj in ("gate_proj", "up_proj", "down_proj"))
    md = (results / "quantize_cost_moe-tiny.md").read_text()
    assert "| gptq | quantkit | 0 |" in md and "| fp8-static | llm-compressor | 0 |" in md
    assert "moe_calibrate_all_experts=True" in md and "re:.*mlp.gate$" in md and "- command: `" in md
    assert "- gptq / llm-compressor, " in md and ": start " in md and ", oneshot " in md and ", the rest " in md


@pytest.mark.slow
def test_wide_records_each_tools_steps(tmp_path: Path) -> None:
    """bench/wide.py kept each run's wall but dropped its stdout, where both tools say their steps: on the full
    30B-A3B's GPTQ (an H100, 2026-12-07) quantkit took 743.7 s against the direct script's 684.1 s, and nothing but
    quantkit's log said where. Both tools' steps are now in results.json and the README's table. FP8 static of the
    tiny MoE on this CPU, both tools, one run each."""
    work, results = tmp_path / "work", tmp_path / "results"
    p = subprocess.run([sys.executable, str(BENCH / "wide.py"), "--shapes", "moe-tiny", "--methods", "fp8-static",
                        "--device", "cpu", "--no-serve", "--samples", "4", "--seq-len", "64", "--workdir", str(work),
                        "--results-dir", str(results)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {c["tool"]: c["result"] for c in json.loads((results / "results.json").read_text())["cases"]
            if c["kind"] == "quantize"}
    q, d = runs["quantkit"], runs["llm-compressor"]
    assert q["rc"] == 0 and d["rc"] == 0 and "stdout" not in q and "stdout" not in d
    assert {"setup", "load_model", "quantize", "save"} <= set(q["timings"])
    assert q["quantize_s"] == q["timings"]["quantize"] and q["calibration_tokens_sha256"]
    assert d["load"].startswith(("load_context", "from_pretrained + linearize_moe"))
    assert {"start", "imports", "load", "oneshot", "save"} == set(d["timings"])
    assert sum(d["timings"].values()) <= d["wall_s"]
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in (results / "README.md").read_text().splitlines()
            if ln.startswith("| moe-tiny/fp8-static/")}
    assert rows["moe-tiny/fp8-static/quantkit"][3].startswith("setup ")
    assert rows["moe-tiny/fp8-static/llm-compressor"][3].startswith("start ")
    assert all(", the rest " in row[3] for row in rows.values())


@pytest.mark.slow
def test_a_warm_up_run_of_each_tool_is_not_counted(workdir: Path, tmp_path: Path) -> None:
    """``--warmup``: each tool runs once more before the timed runs, and only the timed runs are in the results (one
    tool here: the loop is the same for both)."""
    results = tmp_path / "results"
    p = subprocess.run([sys.executable, str(BENCH / "quantize_cost.py"), "--shape", "moe-tiny", "--samples", "2",
                        "--seq-len", "32", "--methods", "fp8-static", "--tools", "llm-compressor", "--warmup",
                        "--workdir", str(workdir),
                        "--results-dir", str(results), "--name", "warm"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("warm-up, not counted: rc 0") == 1 and p.stdout.count("== fp8-static / ") == 2
    runs = json.loads((results / "warm.json").read_text())["runs"]["fp8-static"]
    assert list(runs) == ["llm-compressor"] and len(runs["llm-compressor"]["walls_s"]) == 1


def test_estimate_prints_both_lease_sizes() -> None:
    p = subprocess.run([sys.executable, str(BENCH / "quantize_cost.py"), "--shape", "qwen3-30b-a3b-12l",
                        "--estimate"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith(("| gptq", "| fp8-static"))]
    assert [r.split(" | ")[1] for r in rows] == ["512 x 2048", "128 x 2048", "32 x 2048"] * 2


# ------------------------------------------------------------------------------------------------------------------
# The cost model: what a run computes


def test_cost_model_counts_every_expert_on_every_token() -> None:
    """With moe_calibrate_all_experts every expert runs every calibration token, twice (calibrate, propagate)."""
    s = SHAPES["moe-tiny"]
    L, n = 64, 4
    attn = 256 * 512 + 2 * 256 * 256 + 512 * 256  # q, k, v, o (4 heads x 128; 2 KV heads x 128)
    experts = 8 * 3 * 256 * 256
    est = cost_model.estimate(s, "gptq", n, L)
    assert est["forward_flops"] == 2 * n * 2 * (2 * L * (attn + experts) + 2 * L * L * 4 * 128)
    hessians = 2 * L * (3 * 256**2 + 512**2 + 8 * (2 * 256**2 + 256**2))
    assert est["hessian_flops"] == 2 * n * hessians
    assert cost_model.estimate(s, "fp8-static", n, L)["hessian_flops"] == 0
    assert cost_model.parameters(s) == 2 * (attn + experts + 256 * 8) + 2 * 8192 * 256
    with pytest.raises(ValueError, match="no cost model for 'awq'"):
        cost_model.estimate(s, "awq", n, L)


def measured_h200_runs() -> list[tuple[str, str, int, int, float]]:
    """(shape, method, samples, seq_len, wall) of every committed H200 run the cost model is fitted to, read from
    the result files: llm-compressor called directly where it ran (the model's subject), else quantkit."""
    h200 = BENCH / "results" / "h200"
    runs = []
    for path in (h200 / "8b" / "quantize_cost_8b_medians.json",
                 BENCH / "results" / "quantize_cost_qwen3-30b-a3b-12l.json",
                 h200 / "70b" / "quantize_cost_70b-4l.json", h200 / "70b" / "quantize_cost_70b-8l.json"):
        doc = json.loads(path.read_text())
        for method, tools in doc["runs"].items():
            if method in cost_model.MODELLED:
                run = tools.get("llm-compressor") or tools["quantkit"]
                runs.append((doc["shape"], method, doc["samples"], doc["seq_len"], run["wall_s"]))
    for folder in ("run1", "run2"):
        doc = json.loads((h200 / "wide" / folder / "results.json").read_text())
        runs += [(c["shape"], c["method"], doc["samples"], doc["seq_len"], c["result"]["wall_s"])
                 for c in doc["cases"]
                 if c["kind"] == "quantize" and c["tool"] == "llm-compressor" and c["result"].get("rc") == 0]
    return runs


def test_cost_model_predicts_every_measured_h200_run_within_a_fifth() -> None:
    """The rates are fitted to the H200's runs; a result committed later that the model misses by more than 20% means
    the model (or the run) needs a look before the next GPU run is planned with it."""
    runs = measured_h200_runs()
    assert len(runs) >= 10 and {r[0] for r in runs} >= {"8b", "32b-8l", "qwen3-30b-a3b-12l", "70b-4l", "70b-8l"}
    off = {}
    for shape, method, samples, seq_len, wall in runs:
        est = cost_model.estimate(SHAPES[shape], method, samples, seq_len)["wall_s"]
        off[(shape, method, wall)] = round(est / wall, 2)
    assert all(0.8 <= r <= 1.2 for r in off.values()), off


# ------------------------------------------------------------------------------------------------------------------
# What a decode step reads, and serve_speed.py without vLLM


def test_step_bytes_of_an_moe_checkpoint(workdir: Path) -> None:
    sb = step_bytes.count(workdir / "src-moe-tiny")
    embed = lm_head = 8192 * 256 * 2
    experts = 2 * 8 * 3 * 256 * 256 * 2  # 2 layers, 8 experts, 3 projections, bf16
    assert (sb.num_experts, sb.top_k, sb.experts) == (8, 2, experts)
    assert sb.always == sb.total - embed - experts and sb.always > lm_head  # lm_head, attention, norms, routers
    assert sb.read(1) == sb.always + experts * 2 / 8  # top-2 of 8 per layer
    hit = 8 * (1 - (1 - 2 / 8) ** 16)  # expected distinct experts of 16 tokens under uniform routing
    assert sb.experts_hit(16) == pytest.approx(hit) and sb.read(16) == pytest.approx(sb.always + experts * hit / 8)
    assert sb.experts_hit(16, bound=True) == 8 and sb.experts_hit(3, bound=True) == 6
    qwen = step_bytes.StepBytes(0, 0, 128, 128, 8)
    assert qwen.experts_hit(16) == pytest.approx(82.4, abs=0.05)  # the figure the docs quote


def test_step_bytes_of_a_dense_checkpoint(tiny: Path) -> None:
    sb = step_bytes.count(tiny)
    assert not sb.moe and sb.read(1) == sb.read(16) == sb.always == sb.total - 8192 * 256 * 2  # untied embedding


def test_shared_experts_are_read_every_step(tmp_path: Path) -> None:
    """Only routed experts scale with the batch: a shared expert ("shared_experts.") is read every step."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(4, 4),
               "model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(4, 4),
               "model.layers.0.mlp.shared_experts.down_proj.weight": torch.zeros(4, 4),
               "model.embed_tokens.weight": torch.zeros(8, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 2, "num_experts_per_tok": 1}))
    sb = step_bytes.count(tmp_path)
    assert (sb.experts, sb.always, sb.num_experts, sb.top_k) == (128, 64, 2, 1) and sb.read(1) == 64 + 64


def test_serve_speed_rows_without_vllm(workdir: Path, tmp_path: Path) -> None:
    """The parent on this CPU: each checkpoint's vLLM child fails (no vLLM), the rows still carry the MoE bytes
    and limits, and the unquantized checkpoint is the bf16 row."""
    src = workdir / "src-moe-tiny"
    p = subprocess.run([sys.executable, str(BENCH / "serve_speed.py"), str(src), "--vllm-path", str(tmp_path / "none"),
                        "--results-dir", str(tmp_path), "--logs", str(tmp_path / "logs"), "--name", "moe",
                        "--timeout", "120", "--tp", "1,2", "--bandwidth", "4.8e12"], capture_output=True, text=True,
                       env=ENV, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    row, row2 = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert (row["tp"], row2["tp"]) == (1, 2) and row2["limit_b1"] == pytest.approx(2 * row["limit_b1"])
    request2 = json.loads((tmp_path / "logs" / "src-moe-tiny-tp2.request.json").read_text())
    assert request2["engine_args"]["tensor_parallel_size"] == 2
    sb = step_bytes.count(src)
    assert row["checkpoint"] == "bf16" and "vllm" in row["error"] and row["num_experts"] == 8
    assert row["limit_b1"] == pytest.approx(4.8e12 / sb.read(1))
    assert row["limit_b16"] == pytest.approx(16 * 4.8e12 / sb.read(16))
    assert row["limit_b16_all_distinct"] == pytest.approx(16 * 4.8e12 / sb.read(16, bound=True))
    md = (tmp_path / "moe.md").read_text()
    assert "| bf16 | bfloat16 |" in md and "(2/8 experts, top-k)" in md and "(7.92/8 experts, expected)" in md
    request = json.loads((tmp_path / "logs" / "src-moe-tiny.request.json").read_text())
    assert request["engine_args"]["compilation_config"] == {"cudagraph_capture_sizes": [1, 16]}


def test_rows_are_named_by_quantkit_method(tmp_path: Path) -> None:
    art = tmp_path / "out-quantkit-gptq"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    (art / "quantkit.json").write_text(json.dumps({"method": "gptq", "quantization": {"scheme": "W4A16"}}))
    assert serve_speed.label(art) == "gptq W4A16"
    (art / "quantkit.json").unlink()
    assert serve_speed.label(art) == "out-quantkit-gptq"
