"""Mixture-of-experts through the llm-compressor producers, end to end on small random MoE checkpoints.

Each family (tests/moe_models.py: Qwen3-MoE, Mixtral, DeepSeek-V3 with MLA, a dense first layer and a shared
expert) is quantized through the CLI with real llm-compressor and real calibration, and the test reads what is on
disk: every expert projection of every MoE layer quantized (under the checkpoint's own names), routers, shared
experts' gates and lm_head untouched, finite scales, and the manifest's coverage and per-expert router counts.

What runs, to stay affordable on a shared 2-core CPU (about 15 runs of a few seconds each): every method (awq, gptq,
fp8 static/dynamic/block, int8, rtn) on Qwen3-MoE; Mixtral and DeepSeek-V3 with gptq and awq (the two that
calibrate through the experts and smooth into the router), plus an 8-bit run of each for a numerical check after
reloading in transformers; the fused 3-D expert layout of Qwen3-MoE and Mixtral; Qwen2-MoE for its shared-expert
gate (a real ``nn.Linear`` a ``Linear`` target would otherwise take). Failures are provoked for real: a recipe whose
ignore list catches experts is refused before loading (exit 2); a checkpoint missing an expert's weight exits 2.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from quantkit import calibration, recipe  # noqa: E402
from quantkit.cli.main import app  # noqa: E402
from quantkit.errors import BackendError  # noqa: E402
from quantkit.producers import coverage, moe  # noqa: E402

from conftest import TINY, quantkit  # noqa: E402
from moe_models import make_moe  # noqa: E402

CALIB = ["--samples", "4", "--seq-len", "64"]
TOKENS = 4 * 64
# artifact name -> (checkpoint, command line after MODEL OUTPUT)
ARTIFACTS: dict[str, tuple[str, list[str]]] = {
    "qwen-awq": ("qwen3moe", ["awq", *CALIB]),
    "qwen-gptq": ("qwen3moe", ["gptq", *CALIB]),
    "qwen-fp8": ("qwen3moe", ["fp8", *CALIB]),
    "qwen-fp8-dynamic": ("qwen3moe", ["fp8", "--scheme", "dynamic"]),
    "qwen-fp8-block": ("qwen3moe", ["fp8", "--scheme", "block"]),
    "qwen-int8": ("qwen3moe", ["int8", *CALIB]),
    "qwen-rtn": ("qwen3moe", ["rtn"]),
    "qwen-fused-rtn8": ("qwen3moe-fused", ["rtn", "--bits", "8", "--group-size", "-1"]),
    "mixtral-gptq": ("mixtral", ["gptq", *CALIB]),
    "mixtral-awq": ("mixtral", ["awq", *CALIB]),
    "mixtral-rtn8": ("mixtral", ["rtn", "--bits", "8", "--group-size", "-1"]),
    "mixtral-fused-rtn8": ("mixtral-fused", ["rtn", "--bits", "8", "--group-size", "-1"]),
    "deepseek-gptq": ("deepseek3", ["gptq", *CALIB]),
    "deepseek-awq": ("deepseek3", ["awq", *CALIB]),
    "deepseek-rtn8": ("deepseek3", ["rtn", "--bits", "8", "--group-size", "-1"]),
}
CALIBRATED = {name for name, (_, args) in ARTIFACTS.items() if "--samples" in args}
# checkpoint name -> (family in tests/moe_models.py, fused experts)
CHECKPOINTS = {"qwen3moe": ("qwen3moe", False), "qwen3moe-fused": ("qwen3moe", True), "mixtral": ("mixtral", False),
               "mixtral-fused": ("mixtral", True), "deepseek3": ("deepseek3", False)}


pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-src")
    made: dict[str, Path] = {}

    def _make(name: str) -> Path:
        if name not in made:
            fam, fused = CHECKPOINTS[name]
            made[name] = make_moe(fam, root / name, fused=fused)
        return made[name]

    return _make


@pytest.fixture(scope="module")
def build(tmp_path_factory, checkpoint):
    """Build an artifact through the CLI (in process) once per module; returns (folder, its manifest)."""
    root = tmp_path_factory.mktemp("moe-out")
    done: dict[str, tuple[Path, dict]] = {}

    def _build(name: str) -> tuple[Path, dict]:
        if name not in done:
            src, (verb, *flags) = checkpoint(ARTIFACTS[name][0]), ARTIFACTS[name][1]
            out = root / name
            res = CliRunner().invoke(app, [verb, str(src), str(out), *flags, "--json"])
            assert res.exit_code == 0, f"quantkit {verb} {src.name} failed:\n{res.output}\n{res.stderr}"
            done[name] = (out, json.loads((out / "quantkit.json").read_text()))
        return done[name]

    return _build


def tensors(path: Path) -> dict[str, Any]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def checkpoint_experts(cfg: dict[str, Any]) -> dict[int, list[str]]:
    """Per MoE layer, every expert projection's tensor prefix as the family's checkpoints name it (independent of
    quantkit's table: Mixtral's hub names are block_sparse_moe.experts.E.w1/w2/w3)."""
    kind = cfg["model_type"]
    layers = range(cfg["num_hidden_layers"])
    if kind == "mixtral":
        return {i: [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}" for e in range(cfg["num_local_experts"])
                    for w in ("w1", "w2", "w3")] for i in layers}
    n = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"]
    moe_layers = [i for i in layers if i >= cfg.get("first_k_dense_replace", 0)]
    projections = ("gate_proj", "up_proj", "down_proj")
    return {i: [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(n) for p in projections] for i in moe_layers}


def router(cfg: dict[str, Any], layer: int) -> str:
    return f"model.layers.{layer}.{'block_sparse_moe' if cfg['model_type'] == 'mixtral' else 'mlp'}.gate.weight"


def assert_quantized(t: dict[str, Any], prefix: str) -> None:
    """One Linear stored quantized: packed int4/int8 or fp8/int8 weights, with finite positive scales."""
    if f"{prefix}.weight_packed" in t:
        assert t[f"{prefix}.weight_packed"].dtype == torch.int32 and f"{prefix}.weight" not in t, prefix
    else:
        assert t[f"{prefix}.weight"].dtype in (torch.float8_e4m3fn, torch.int8), (prefix, t[f"{prefix}.weight"].dtype)
    scale = t[f"{prefix}.weight_scale"].float()
    assert torch.isfinite(scale).all() and (scale > 0).all(), prefix


def assert_moe_artifact(name: str, out: Path, manifest: dict, source: Path) -> None:
    cfg = config(source)
    t = tensors(out)
    src = tensors(source)
    experts = checkpoint_experts(cfg)
    assert experts and all(len(v) == 3 * 8 for v in experts.values())
    for names in experts.values():
        for prefix in names:
            assert_quantized(t, prefix)
    # routers, shared-expert gates (none in these families' checkpoints) and lm_head stay in bf16, unquantized
    for i in experts:
        r = router(cfg, i)
        assert t[r].dtype == torch.bfloat16 and r.replace(".weight", ".weight_scale") not in t, r
    assert t["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale" not in t
    assert torch.equal(t["lm_head.weight"], src["lm_head.weight"])
    # every Linear is quantized: nothing but norms, embeddings, routers, biases and lm_head left as plain bf16 weights
    plain = [k for k, v in t.items() if k.endswith(".weight") and v.dtype == torch.bfloat16 and v.dim() == 2]
    assert all(k.endswith(("embed_tokens.weight", "lm_head.weight", ".gate.weight")) for k in plain), plain
    q = manifest["quantization"]
    assert q["coverage"]["expected"] == q["coverage"]["quantized"] > 0
    assert q["coverage"]["expert_projections"] == sum(map(len, experts.values()))
    info = q["moe"]
    assert (info["experts"], info["top_k"], info["layers"]) == (8, 2, sorted(experts))
    assert info["calibrate_all_experts"] is True and info["routers"] == [r"re:.*\.mlp\.gate$"]
    assert any(r"re:.*\.mlp\.gate$" in m.get("ignore", []) for step in q["recipe"] for m in step.values())
    tokens = info["expert_tokens"]
    if name in CALIBRATED:
        assert tokens["calibration_tokens"] == TOKENS and tokens["complete"]
        for layer in experts:
            counts = tokens["per_layer"][str(layer)]
            assert len(counts) == 8 and sum(counts) == TOKENS * 2, (layer, counts)
        assert tokens["min"] == min(min(c) for c in tokens["per_layer"].values())
        low = {k: [e for e, n in enumerate(c) if n < 16] for k, c in tokens["per_layer"].items()}
        assert tokens["below_threshold"] == {k: v for k, v in low.items() if v}
    else:
        assert tokens is None and manifest["calibration"] is None


@pytest.mark.parametrize("name", list(ARTIFACTS))
def test_every_expert_quantized(build, checkpoint, name):
    out, manifest = build(name)
    assert_moe_artifact(name, out, manifest, checkpoint(ARTIFACTS[name][0]))


def test_schemes_on_experts(build):
    """Each method's layout reaches the experts (not only attention)."""
    expert = "model.layers.1.mlp.experts.5.down_proj"
    expect = {"qwen-awq": ("pack-quantized", 4, torch.int32), "qwen-gptq": ("pack-quantized", 4, torch.int32),
              "qwen-rtn": ("pack-quantized", 4, torch.int32), "qwen-int8": ("int-quantized", 8, torch.int8),
              "qwen-fp8": ("float-quantized", 8, torch.float8_e4m3fn),
              "qwen-fp8-dynamic": ("float-quantized", 8, torch.float8_e4m3fn),
              "qwen-fp8-block": ("float-quantized", 8, torch.float8_e4m3fn)}
    for name, (fmt, bits, dtype) in expect.items():
        out, _ = build(name)
        qc = config(out)["quantization_config"]
        assert qc["format"] == fmt and qc["config_groups"]["group_0"]["weights"]["num_bits"] == bits
        t = tensors(out)
        w = t.get(f"{expert}.weight_packed", t.get(f"{expert}.weight"))
        assert w.dtype == dtype, name
    t = tensors(build("qwen-fp8")[0])
    assert t[f"{expert}.input_scale"].item() > 0  # static fp8: the expert's activation scale was calibrated
    assert tuple(tensors(build("qwen-fp8-block")[0])[f"{expert}.weight_scale"].shape) == (256 // 128, 256 // 128)


def test_router_counts_are_the_real_routers(build, checkpoint):
    """The first MoE layer's counts are an independent count: the unquantized model's own router on the same
    calibration tokens (layer 0 of Qwen3-MoE sees nothing quantized before its calibration pass).

    llm-compressor 0.14.0.1's sequential pipeline runs its traced layers without the causal mask here (the counts
    match a forward pass with a fully visible mask, to within a few near-tie tokens, and differ from the causal one
    by far more): the counts are what the calibration pass routed, so both references are accepted, each within 2%
    of the 512 choices. A uniform split, another layer's or another run's counts would match neither.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = checkpoint("qwen3moe")
    _, manifest = build("qwen-gptq")
    samples = calibration.build(recipe.CalibrationSpec(samples=4, seq_len=64),
                                AutoTokenizer.from_pretrained(src)).samples
    assert manifest["calibration"]["tokens"] == TOKENS
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    counts = torch.zeros(8, dtype=torch.long)

    def hook(module, args, output):
        counts.add_(torch.bincount(output[2].reshape(-1), minlength=8))

    model.model.layers[0].mlp.gate.register_forward_hook(hook)
    references = {}
    for mask in ("causal", "full"):
        counts.zero_()
        with torch.no_grad():
            for s in samples:
                full = torch.zeros(1, 1, len(s), len(s), dtype=torch.bfloat16) if mask == "full" else None
                model(torch.tensor([s]), attention_mask=full)
        references[mask] = counts.clone()
    got = torch.tensor(manifest["quantization"]["moe"]["expert_tokens"]["per_layer"]["0"])
    distance = {mask: (got - ref).abs().sum().item() for mask, ref in references.items()}
    assert min(distance.values()) <= 0.02 * 2 * TOKENS, (got.tolist(), {k: v.tolist() for k, v in references.items()})
    assert (references["causal"] - references["full"]).abs().sum().item() > 0.1 * 2 * TOKENS
    assert len(set(got.tolist())) > 1


def test_awq_smooths_routers_with_their_experts(build, checkpoint):
    """AWQ rescales the norm before the router and experts: the router's weights are rescaled with them (else
    routing shifts). On DeepSeek-V3 that needs llm-compressor's mapping split around the dense first layer."""
    for name in ("qwen-awq", "deepseek-awq"):
        out, manifest = build(name)
        cfg = config(checkpoint(ARTIFACTS[name][0]))
        layer = 1
        src = tensors(checkpoint(ARTIFACTS[name][0]))
        assert not torch.equal(tensors(out)[router(cfg, layer)], src[router(cfg, layer)]), name
    source = build("deepseek-awq")[1]["quantization"]["awq_mappings_source"]
    assert "split into MoE and dense layers" in source
    assert "split" not in build("qwen-awq")[1]["quantization"]["awq_mappings_source"]


def _log_probs(path: Path, ids: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype="auto", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (path, info)
    with torch.no_grad():
        logits = model.eval()(ids).logits.float()
    assert torch.isfinite(logits).all()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("name", ["qwen-fused-rtn8", "mixtral-rtn8", "mixtral-fused-rtn8", "deepseek-rtn8"])
def test_reloads_in_transformers_close_to_the_source(build, checkpoint, name):
    """Every weight found under the names transformers reads (Mixtral's w1/w2/w3 included), and at 8 bits the
    model is the source's (KL 0.02-0.03 nats, top-1 0.83 on these random models): a swapped, missing or randomly
    initialised expert is far off (a Mixtral saved under llm-compressor's own names: KL 2.0, top-1 0.0)."""
    source = checkpoint(ARTIFACTS[name][0])
    ids = torch.tensor([calibration.build(recipe.CalibrationSpec(dataset="heldout", samples=2, seq_len=128),
                                          __import__("transformers").AutoTokenizer.from_pretrained(source)).samples[0]])
    base, quant = _log_probs(source, ids), _log_probs(build(name)[0], ids)
    kld = (base.exp() * (base - quant)).sum(-1).mean().item()
    top1 = (base.argmax(-1) == quant.argmax(-1)).float().mean().item()
    assert kld < 0.1 and top1 > 0.7, (name, kld, top1)


def test_low_token_experts_warn(tmp_path, checkpoint):
    """A real process: calibration.min_expert_tokens above what the router gives every expert warns for each."""
    src = checkpoint("qwen3moe")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"quantize": {"method": "fp8"},
                                    "calibration": {"samples": 4, "seq_len": 64, "min_expert_tokens": 1000}}))
    proc = quantkit("fp8", src, tmp_path / "out", "--recipe", path, "--json", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stderr = " ".join(proc.stderr.split())
    assert "16 expert(s) got fewer than 1000 calibration tokens from the router" in stderr
    assert "layer 0: expert 0 got" in stderr and "and 1 more" not in stderr
    tokens = json.loads(proc.stdout)[0]["quantization"]["moe"]["expert_tokens"]
    assert tokens["threshold"] == 1000 and tokens["below_threshold"] == {"0": list(range(8)), "1": list(range(8))}
    assert any("fewer than 1000" in n for n in json.loads(proc.stdout)[0]["notes"])


@pytest.mark.parametrize("ignore,n,caught", [
    (r"re:.*experts\.[0-2]\..*", 18, "model.layers.0.mlp.experts.0.gate_proj, model.layers.0.mlp.experts.0.up_proj"),
    ("re:.*down_proj$", 16, "model.layers.0.mlp.experts.0.down_proj, model.layers.0.mlp.experts.1.down_proj"),
])
def test_experts_the_ignore_list_catches_are_refused_before_loading(tmp_path, checkpoint, ignore, n, caught):
    """A recipe whose ignore list catches experts (every expert must be quantized): refused in one line, exit 2, from
    the headers before anything loads, and by --dry-run too; the experts are named. It used to be found by the
    coverage check after quantizing (exit 1)."""
    src = checkpoint("qwen3moe")
    out = tmp_path / "out"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"quantize": {"method": "rtn", "ignore": ["lm_head", ignore]}}))
    for flags in (["--dry-run"], []):
        proc = quantkit("rtn", src, out, "--recipe", path, *flags, env={"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 2, proc.stderr[-3000:]
        err = " ".join(proc.stderr.split())
        assert err.startswith(f"error: the ignore list keeps {n} expert projection(s) in full precision ({caught}"), err
        assert "every expert of a mixture-of-experts model must be quantized" in err and "Traceback" not in err
        assert "Loading" not in proc.stdout + proc.stderr
        assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("name,key,words", [
    ("qwen3moe-fused", "model.layers.1.mlp.experts.gate_up_proj", "weights the model needs are not in the checkpoint"),
    ("qwen3moe", "model.layers.1.self_attn.o_proj.weight", "weights the model needs are not in the checkpoint"),
    ("qwen3moe", "model.layers.1.mlp.experts.3.up_proj.weight", "weights the model needs are not in the checkpoint"),
])
def test_missing_weights_are_refused(tmp_path, checkpoint, name, key, words):
    """A checkpoint without some tensor would load with those weights random: refused before quantizing, exit 2."""
    src = tmp_path / "broken"
    shutil.copytree(checkpoint(name), src)
    t = tensors(src)
    del t[key]
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    proc = quantkit("rtn", src, tmp_path / "out", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    ours = err[err.rindex("error: "):]  # transformers prints its own load report (and trace) above
    assert words in ours and "Traceback" not in ours, err
    if "not in the checkpoint" in words:
        assert key.removesuffix(".weight") in err
    assert not (tmp_path / "out").exists()


def test_the_memory_plan_counts_the_experts_only_where_the_load_stacks_them(checkpoint):
    """FP8 static only observes the weights, so the plan's host figure counts none of a model whose load keeps it in
    the source's mapped pages: a per-expert checkpoint, built straight into per-expert Linears on transformers
    5.17. The same model saved fused loads into 3-D expert tensors of the process's own: the figure is higher by
    exactly its experts' bytes. GPTQ rewrites every weight into its own memory: the same figure for both layouts,
    its Hessians counted per expert Linear from the fused 3-D tensors too (they were missed before)."""
    from quantkit import plan, source

    experts = sum(stop - start for f in checkpoint("qwen3moe").glob("*.safetensors")
                  for name, t in source.safetensors_header(f)[0].items() if ".experts." in name
                  for start, stop in [t["data_offsets"]])
    assert experts > 0 and moe.TRANSFORMERS_READ == "5.17.0"

    def host(name: str, method: dict[str, Any]) -> int:
        r = recipe.Recipe.model_validate({"model": {"source": str(checkpoint(name))}, "output": "unused",
                                          "quantize": method})
        return plan.memory(r, r.quantize, source.resolve(r.model))[0]

    fp8 = {"method": "fp8", "scheme": "static"}
    assert host("qwen3moe-fused", fp8) - host("qwen3moe", fp8) == experts
    # the same but for the files' headers (the model is counted as the source's size on disk)
    assert host("qwen3moe-fused", {"method": "gptq"}) == pytest.approx(host("qwen3moe", {"method": "gptq"}), rel=1e-3)


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek3", "qwen3moe-fused", "mixtral"])
def test_experts_load_from_the_checkpoint_in_either_layout(checkpoint, name):
    """A checkpoint with one tensor per expert is built straight into llm-compressor's per-expert Linears (the save
    mapping it leaves renames only: no 3-D stacking at load to copy apart after, bench/results/moe_load_*.md); a
    fused one, and Mixtral (no per-expert load mapping in llm-compressor), load plainly and are linearized. Either
    way every expert weight is the checkpoint's tensor, and the load leaves transformers' class patches and the
    family's conversion mapping as they were, so a later plain load in the process stacks its experts again."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter
    from transformers.monkey_patching import get_patch_mapping

    from quantkit import source
    from quantkit.producers import oneshot
    from quantkit.producers.job import Job

    src = checkpoint(name)
    cfg = config(src)
    fused = CHECKPOINTS[name][1]
    assert moe.per_expert_checkpoint(source.tensor_names(src)) is not fused
    mapping = repr(get_checkpoint_conversion_mapping(cfg["model_type"]))
    model = oneshot.load_model(Job.model_construct(source=str(src), config=cfg, dtype="auto",
                                                   trust_remote_code=False))
    if name in ("qwen3moe", "deepseek3"):  # the plain load leaves the converters that stacked the experts
        conversions = model._weight_conversions
        assert conversions and not any(isinstance(c, WeightConverter) for c in conversions), conversions
    assert repr(get_checkpoint_conversion_mapping(cfg["model_type"])) == mapping and not get_patch_mapping()
    fam = moe.family(cfg)
    blocks = expert_blocks = 0
    prefix = moe.layer_prefix(model)
    for i in fam.layers(cfg):
        expert_blocks += 1
        blocks += isinstance(model.get_submodule(f"{prefix}.{i}.{fam.experts}"), LinearExperts2D)
    assert blocks == expert_blocks > 0
    held = model.state_dict()
    stored = tensors(src)
    ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    compared = 0
    for i in fam.layers(cfg):
        for e in range(fam.num_experts(cfg)):
            mem = f"{prefix}.{i}.{fam.experts}.{e}"
            if fused:
                gate_up = stored[f"{prefix}.{i}.{fam.experts}.gate_up_proj"][e]
                want = {"gate_proj": gate_up[:ffn], "up_proj": gate_up[ffn:],
                        "down_proj": stored[f"{prefix}.{i}.{fam.experts}.down_proj"][e]}
            elif fam.checkpoint_block or fam.checkpoint_projections:
                block = f"{prefix}.{i}.{fam.checkpoint_block or fam.experts.rsplit('.', 1)[0]}.experts.{e}"
                want = {p: stored[f"{block}.{fam.checkpoint_projections.get(p, p)}.weight"] for p in fam.projections}
            else:
                want = {p: stored[f"{mem}.{p}.weight"] for p in fam.projections}
            for p in fam.projections:
                assert torch.equal(held[f"{mem}.{p}.weight"], want[p]), f"{mem}.{p}"
                compared += 1
    assert compared == len(fam.layers(cfg)) * fam.num_experts(cfg) * len(fam.projections)


def test_shared_expert_gate_stays_unquantized(tmp_path):
    """Qwen2-MoE's shared-expert gate is an nn.Linear (hidden -> 1): the family's patterns keep it, and the router,
    in full precision while every expert and the shared expert are quantized."""
    import transformers

    cfg = transformers.Qwen2MoeConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
                                      num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                      intermediate_size=512, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = tmp_path / "qwen2moe"
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, src / f)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["rtn", str(src), str(out), "--json"])
    assert res.exit_code == 0, res.output
    t = tensors(out)
    for i in range(2):
        gate = f"model.layers.{i}.mlp.shared_expert_gate"
        assert t[f"{gate}.weight"].dtype == torch.bfloat16 and f"{gate}.weight_scale" not in t
        assert_quantized(t, f"model.layers.{i}.mlp.shared_expert.down_proj")
        for e in range(4):
            assert_quantized(t, f"model.layers.{i}.mlp.experts.{e}.gate_proj")
    q = json.loads((out / "quantkit.json").read_text())["quantization"]
    assert q["moe"]["routers"] == [r"re:.*\.mlp\.gate$", r"re:.*\.mlp\.shared_expert_gate$"]
    assert q["coverage"]["expert_projections"] == 2 * 4 * 3


def test_router_patterns_match_every_router(checkpoint):
    """Each family's patterns match the router of every MoE layer and nothing else (so a default ignore list can
    hold them under a "pattern matches nothing" rule); a dense model has none."""
    from compressed_tensors.utils import is_match
    from transformers import AutoModelForCausalLM

    for name in ("qwen3moe", "mixtral", "deepseek3"):
        src = checkpoint(name)
        cfg = config(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        patterns = moe.router_patterns(cfg)
        matched = [n for n, m in model.named_modules() if is_match(n, m, patterns)]
        assert matched == [f"model.layers.{i}.mlp.gate" for i in moe.family(cfg).layers(cfg)], name
    assert moe.router_patterns(config(TINY)) == [] and moe.family(config(TINY)) is None


def test_coverage_on_a_dense_model():
    """The check for every method, dense models included: a targeted Linear left unquantized, a NaN scale, and an
    ignored module that was quantized are each reported by name; lm_head ignored is fine."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16)
    oneshot(model=model, recipe=[QuantizationModifier(targets=["Linear"], scheme="W8A16", ignore=["lm_head"])])
    cfg = config(TINY)
    cov = coverage.check(model, ["lm_head"], cfg)
    assert cov.ok and cov.expected == cov.quantized == 7 * cfg["num_hidden_layers"] and cov.experts is None
    cov.raise_for_failures()
    layer = model.model.layers[1]
    del layer.mlp.up_proj.quantization_scheme
    layer.self_attn.o_proj.weight_scale.data[0] = float("nan")
    cov = coverage.check(model, ["lm_head", "re:.*k_proj$"], cfg)
    assert cov.missing == ["model.layers.1.mlp.up_proj"]
    assert cov.bad_scales == ["model.layers.1.self_attn.o_proj"]
    assert cov.ignored_but_quantized == [f"model.layers.{i}.self_attn.k_proj" for i in range(cfg["num_hidden_layers"])]
    with pytest.raises(BackendError) as err:
        cov.raise_for_failures()
    text = str(err.value)
    assert "model.layers.1.mlp.up_proj" in text and "NaN, infinite or zero scales" in text
    assert re.search(r"\d+ modules the ignore list names were quantized", text)


def test_eval_scores_asymmetric_experts(build, checkpoint, tmp_path):
    """transformers 5.17 cannot reload asymmetric int4 experts (AWQ's default); `quantkit eval` scores them through
    a dense copy and says so, instead of failing the whole evaluation."""
    out, _ = build("qwen-awq")
    proc = quantkit("eval", out, "--baseline", checkpoint("qwen3moe"), "--dataset", "heldout", "--max-tokens", "512",
                    "--ctx", "256", "--report-dir", tmp_path, "--json")
    assert proc.returncode in (0, 3), proc.stderr[-2000:]  # a random model may miss the default gates
    (result,) = json.loads(proc.stdout)["results"]
    assert "dense copy" in result["engine"]["loaded"] and result["kld"] is not None and result["top1"] > 0
