"""A bits target (``--target-bits``): a mixed int4/int8 compressed-tensors checkpoint chosen by measured sensitivity.

On the reference model, through the real CLI and llm-compressor: the plan's bits equal the bits counted from the
files and sit within the tolerance of the target; each module's stored width is the plan's; transformers loads the
checkpoint; and the mix scores a lower KLD than int4 everywhere with the same method, on the same held-out tokens
(``quantkit eval``). A target outside what the two precisions mix to, a legacy layout, an MoE model, --bits 8 and a
method that cannot mix are refused in one line, before anything loads; a target inside that range is met (the nearest
mix, over or under), or, on a model of few large layer groups where no mix comes within the tolerance, refused right
after the plan, before the method runs. The real model's figures are in bench/results/quality_4bit_*.md.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

from quantkit.producers import mixed  # noqa: E402
from quantkit.source import safetensors_header  # noqa: E402

from conftest import TINY, quantkit  # noqa: E402
from moe_models import make_moe  # noqa: E402

pytestmark = pytest.mark.e2e

CALIB = ["--samples", "4", "--seq-len", "256"]
TARGET = 5.5  # gptq's mix at 5.5 bits and up: int4 in groups of 32 with zero points


@pytest.fixture(scope="module")
def made(tiny_rtn: Path, tmp_path_factory) -> dict[str, Path]:
    """RTN and GPTQ on the reference model: int4 everywhere (the session's RTN artifact, copied: eval records its
    scores in it) and with a bits target."""
    root = tmp_path_factory.mktemp("target-bits")
    out = {"rtn": root / "rtn"}
    shutil.copytree(tiny_rtn, out["rtn"])
    for name, argv in {"rtn-mixed": ["rtn", "--target-bits", str(TARGET)],
                       "gptq-mixed": ["gptq", "--target-bits", str(TARGET), *CALIB]}.items():
        out[name] = root / name
        proc = quantkit(*argv[:1], TINY, out[name], *argv[1:], "--json", env={"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _manifest(path: Path) -> dict:
    return json.loads((path / "quantkit.json").read_text())


def _stored_bits(path: Path) -> dict[str, int]:
    """Each quantized module's weight width as stored: its packed int32 columns x 32 over its input width."""
    from safetensors import safe_open

    out = {}
    for file in path.glob("*.safetensors"):
        header, _ = safetensors_header(file)
        with safe_open(str(file), "pt") as f:
            for name, info in header.items():
                if name.endswith(".weight_packed"):
                    module = name.removesuffix(".weight_packed")
                    in_features = int(f.get_tensor(f"{module}.weight_shape")[1])
                    out[module] = info["shape"][1] * 32 // in_features
    return out


@pytest.mark.parametrize("name", ["rtn-mixed", "gptq-mixed"])
def test_bits_counted_from_the_files_meet_the_target(made: dict[str, Path], name: str) -> None:
    m = _manifest(made[name])["quantization"]["mixed"]
    assert abs(m["measured_bits"] - TARGET) <= mixed.TOLERANCE
    assert m["measured_bits"] == pytest.approx(m["planned_bits"], abs=1e-3)
    assert 0 < m["units_at_high"] < m["units"]  # a mix, not all of one precision
    assert m["estimated_kld"] < m["estimated_kld_all_low"]


@pytest.mark.parametrize("name", ["rtn-mixed", "gptq-mixed"])
def test_every_module_is_stored_at_the_width_the_plan_gave_it(made: dict[str, Path], name: str) -> None:
    plan = {mod: u["bits"] for u in _manifest(made[name])["quantization"]["mixed"]["plan"] for mod in u["modules"]}
    stored = _stored_bits(made[name])
    assert stored == plan
    assert set(stored.values()) == {4, 8}


def test_gptq_mix_is_int4_group_32_with_zero_points_and_symmetric_int8(made: dict[str, Path]) -> None:
    """GPTQ's default layout under a bits target, as stored: int4 groups of 32 with zero points, int8 symmetric (vLLM
    0.26 has no kernel for asymmetric 8-bit weights), and the manifest says why."""
    groups = json.loads((made["gptq-mixed"] / "config.json").read_text())["quantization_config"]["config_groups"]
    weights = {g["weights"]["num_bits"]: g["weights"] for g in groups.values()}
    assert set(weights) == {4, 8}
    assert (weights[4]["group_size"], weights[4]["symmetric"]) == (32, False)
    assert (weights[8]["group_size"], weights[8]["symmetric"]) == (32, True)
    q = _manifest(made["gptq-mixed"])["quantization"]
    assert (q["group_size"], q["group_size_requested"], q["symmetric"]) == (32, None, False)
    assert q["group_size_reason"].startswith("a bits target: int4 in groups of 32 with zero points")
    zero_points = [n for f in made["gptq-mixed"].glob("*.safetensors") for n in safetensors_header(f)[0]
                   if n.endswith(".weight_zero_point")]
    assert len(zero_points) == sum(1 for b in _stored_bits(made["gptq-mixed"]).values() if b == 4)


def test_plan_takes_the_costliest_units_per_bit(made: dict[str, Path]) -> None:
    """The greedy order: every unit kept at 8 bits saves at least as much KLD per weight as any unit that would have
    fitted in the budget left."""
    plan = _manifest(made["rtn-mixed"])["quantization"]["mixed"]["plan"]
    high = [u["kld"] / u["params"] for u in plan if u["bits"] == 8]
    low = [u["kld"] / u["params"] for u in plan if u["bits"] == 4]
    assert len(high) + len(low) == len(plan)
    assert sorted(high)[0] >= sorted(low)[len(low) // 2]  # above the median of what stayed at 4 bits


def test_fused_layers_share_one_width(made: dict[str, Path]) -> None:
    """vLLM fuses q/k/v and gate/up into one layer with one scheme: a unit is whole."""
    stored = _stored_bits(made["rtn-mixed"])
    for layer in {re.sub(r"\.(self_attn|mlp)\..*", "", n) for n in stored}:
        assert len({stored[f"{layer}.self_attn.{p}_proj"] for p in "qkv"}) == 1
        assert len({stored[f"{layer}.mlp.{p}_proj"] for p in ("gate", "up")}) == 1


def test_mixed_checkpoint_scores_better_than_int4_everywhere(made: dict[str, Path]) -> None:
    proc = quantkit("eval", made["rtn"], made["rtn-mixed"], "--baseline", TINY, "--dataset", "heldout",
                    "--max-tokens", "2048", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kld = {Path(r["path"]).name: r["kld"] for r in json.loads(proc.stdout)["results"]}
    assert math.isfinite(kld["rtn-mixed"])
    assert kld["rtn-mixed"] < 0.75 * kld["rtn"], kld


def test_transformers_loads_the_mixed_checkpoint(made: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(made["gptq-mixed"], dtype="auto")
    bits = {n: m.quantization_scheme.weights.num_bits for n, m in model.named_modules()
            if getattr(m, "quantization_scheme", None) is not None}
    plan = {mod: u["bits"] for u in _manifest(made["gptq-mixed"])["quantization"]["mixed"]["plan"]
            for mod in u["modules"]}
    assert bits == plan
    out = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(out).all()


@pytest.mark.cli
@pytest.mark.parametrize("argv, words", [
    (["rtn", "--target-bits", "9.5"], "outside what int4 and int8 layers mix to"),
    (["rtn", "--target-bits", "3"], "outside what int4 and int8 layers mix to"),
    (["gptq", "--target-bits", "5", "--bits", "8"], "leave bits at 4"),
    (["gptq", "--target-bits", "5", "--format", "gptq"], "carries one bit width"),
    (["autoround", "--target-bits", "5"], "No such option"),
])
def test_refused_before_loading(tmp_path: Path, argv: list[str], words: str) -> None:
    proc = quantkit(argv[0], TINY, tmp_path / "out", *argv[1:])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_refused_on_a_mixture_of_experts_model(tmp_path: Path) -> None:
    model = make_moe("qwen3moe", tmp_path / "moe")
    proc = quantkit("rtn", model, tmp_path / "out", "--target-bits", "5")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mixture-of-experts" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_targets_name_exactly_the_planned_modules() -> None:
    """The compressed-tensors target expressions match the modules at their width and nothing else."""
    names = [f"model.layers.{i}.{p}" for i in range(12) for p in ("self_attn.q_proj", "self_attn.o_proj",
                                                                  "mlp.down_proj")]
    plan = [mixed.Unit(n, (n,), 1, 64, bits=8 if i % 3 == 0 else 4) for i, n in enumerate(names)]
    for bits in (4, 8):
        patterns = [re.compile(t.removeprefix("re:")) for t in mixed.targets(plan, bits)]
        hit = {n for n in names if any(p.match(n) for p in patterns)}
        assert hit == {u.name for u in plan if u.bits == bits}


def test_target_8_on_the_reference_model_is_met(made: dict[str, Path], tmp_path: Path) -> None:
    """QA's case: ``rtn --target-bits 8`` planned 7.875 (greedy in KLD-per-bit order left a gate_up at int4, and
    adding it back gives 8.125), quantized and saved, then failed the files' check. A down_proj left at int4 instead
    lands on 8.0. (After ``made``: its RTN run measured the same sensitivity, which this run reads from the cache.)"""
    proc = quantkit("rtn", TINY, tmp_path / "out", "--target-bits", "8", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _manifest(tmp_path / "out")["quantization"]["mixed"]
    assert abs(m["measured_bits"] - 8) <= mixed.TOLERANCE and m["measured_bits"] == pytest.approx(m["planned_bits"])


def _one_layer(dest: Path) -> Path:
    """The reference model cut to its first decoder layer: 4 layer groups, int4 to int8 mixes a third of a bit apart
    (4.125, 4.458, ...), so a target between two of them is inside the range but more than 0.1 from every mix."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in TINY.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy(f, dest / f.name)
    config = json.loads((TINY / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    tensors = load_file(TINY / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not re.match(r"model\.layers\.[1-9]", k)},
              dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_target_no_mix_comes_near_is_refused_before_quantizing(tmp_path: Path) -> None:
    """Refused right after the plan (exit 2), naming the nearest mixes, before the method runs or anything is saved."""
    proc = quantkit("rtn", _one_layer(tmp_path / "one"), tmp_path / "out", "--target-bits", "4.29",
                    env={"OMP_NUM_THREADS": "1", "QUANTKIT_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "more than 0.1 from every mix these layer groups make (the nearest: 4.125 and 4.458" in proc.stderr
    assert "Quantizing" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def _units(layers: int, kld: dict[tuple[int, str], float] | None = None) -> list[mixed.Unit]:
    """The reference model's layer groups (its widths: hidden 256, intermediate 768, 2 of 4 heads for k and v)."""
    sizes = {"qkv": 131072, "o": 65536, "gate_up": 393216, "down": 196608}
    return [mixed.Unit(f"{i}.{k}", (f"{i}.{k}",), p, 256, (kld or {}).get((i, k), 1.0))
            for i in range(layers) for k, p in sizes.items()]


INT = mixed.int_precision(4, 128, True), mixed.int_precision(8, 128, True)


@pytest.mark.unit
def test_plan_meets_a_target_the_greedy_order_misses() -> None:
    """Greedy in KLD-per-bit order stops 0.125 under 8 bits (the last gate_up does not fit, and adding it is 0.125
    over); the planner finds a mix at 8.0 that loses as little KLD."""
    units = _units(8, {(0, "gate_up"): 0.001})
    low, high = INT
    extra = {u.name: high.cost(u) - low.cost(u) for u in units}
    params, base = sum(u.params for u in units), sum(low.cost(u) for u in units)
    greedy = mixed.greedy({u.name: u.kld for u in units}, extra, 8 * params - base)
    assert (base + sum(extra[n] for n in greedy)) / params == 7.875
    plan = mixed.choose(units, 8.0, low, high)
    assert abs(mixed.planned_bits(plan, low, high) - 8.0) <= mixed.TOLERANCE
    assert sum(u.kld for u in plan if u.bits == mixed.LOW_BITS) == 1.0  # one unit of KLD 1 left at int4, not three


@pytest.mark.unit
def test_plan_takes_one_unit_over_the_target_when_that_is_nearer() -> None:
    low, high = INT
    plan = mixed.choose(_units(1), 4.42, low, high)  # 4.125 under (0.295 away), 4.458 over (0.038)
    assert mixed.planned_bits(plan, low, high) == pytest.approx(4.125 + 1 / 3)
    assert [u.name for u in plan if u.bits == mixed.HIGH_BITS] == ["0.o"]


@pytest.mark.unit
def test_plan_refuses_a_target_no_mix_comes_near() -> None:
    from quantkit.errors import UsageError

    with pytest.raises(UsageError, match=r"the nearest: 4\.125 and 4\.458 bits per weight"):
        mixed.choose(_units(1), 4.29, *INT)


@pytest.mark.unit
def test_files_check_blames_storage_only_when_the_plan_was_within_tolerance() -> None:
    from quantkit.errors import BackendError

    mixed.verify(5.45, 5.5, 5.45)
    with pytest.raises(BackendError) as stored:
        mixed.verify(5.3, 5.5, 5.5)
    assert "stored otherwise than planned" in stored.value.hint
    with pytest.raises(BackendError) as planned:
        mixed.verify(5.3, 5.5, 5.3)
    assert "the plan itself had 5.300" in planned.value.hint and "stored" not in planned.value.hint


# --- GGUF: llama.cpp's mix with the costliest layer groups raised to Q8_0


@pytest.fixture(scope="module")
def gguf_made(tiny_gguf_q4_k_m: Path, tmp_path_factory) -> dict[str, Path]:
    """Q4_K_M on the reference model as llama.cpp mixes it (the session's, copied: eval records its scores in it),
    and raised to a bits target."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gguf-target")
    out = {"q4km": root / "q4km", "q4km-mixed": root / "q4km-mixed"}
    shutil.copytree(tiny_gguf_q4_k_m, out["q4km"])
    proc = quantkit("gguf", TINY, out["q4km-mixed"], "-t", "Q4_K_M", "--target-bits", "5.5", *CALIB, "--json",
                    env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_gguf_bits_counted_from_the_file_meet_the_target(gguf_made: dict[str, Path]) -> None:
    from quantkit.producers.gguf import target_bits

    m = _manifest(gguf_made["q4km-mixed"])["quantization"]["mixed"]
    file = next(gguf_made["q4km-mixed"].glob("*.gguf"))
    assert target_bits.file_bits(file) == pytest.approx(m["measured_bits"], abs=1e-3)
    assert abs(m["measured_bits"] - 5.5) <= mixed.TOLERANCE
    assert m["base_bits"] == pytest.approx(target_bits.file_bits(next(gguf_made["q4km"].glob("*.gguf"))), abs=1e-3)
    from quantkit.producers.gguf import convert

    assert target_bits.floor_bits("Q4_K_M", convert.plan(TINY).tensors) <= m["base_bits"]  # check()'s is a floor
    assert 0 < m["units_at_high"] < m["units"]


def test_gguf_raised_tensors_are_q8_0_and_the_rest_keep_llama_cpp_mix(gguf_made: dict[str, Path]) -> None:
    from quantkit.producers.gguf import target_bits

    plan = _manifest(gguf_made["q4km-mixed"])["quantization"]["mixed"]["plan"]
    raised = {t for u in plan if u["type"] == "Q8_0" for t in u["tensors"]}
    base = target_bits.block_matrices(next(gguf_made["q4km"].glob("*.gguf")))
    got = target_bits.block_matrices(next(gguf_made["q4km-mixed"].glob("*.gguf")))
    assert raised and {n for n, t in got.items() if t.type == "Q8_0"} >= raised
    assert all(got[n].type == base[n].type for n in got if n not in raised)


def test_gguf_mix_scores_better_in_llama_cpp(gguf_made: dict[str, Path]) -> None:
    proc = quantkit("eval", gguf_made["q4km"], gguf_made["q4km-mixed"], "--baseline", TINY, "--dataset", "heldout",
                    "--max-tokens", "2048", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    base, mix = (r["kld"] for r in json.loads(proc.stdout)["results"])  # in the order given
    assert mix < base, (mix, base)


@pytest.mark.cli
@pytest.mark.parametrize("flags, words", [
    (["-t", "Q4_K_M", "-t", "Q6_K"], "exactly one --type"),
    (["-t", "Q8_0"], "exactly one --type"),
    (["-t", "Q4_K_M", "--target-bits", "9"], "above Q8_0"),
    (["-t", "Q4_K_M", "--target-bits", "3"], "below what Q4_K_M's mix spends here: at least 4.50 bits per weight"),
])
def test_gguf_target_refused_before_any_work(tmp_path: Path, flags: list[str], words: str) -> None:
    flags = flags if "--target-bits" in flags else [*flags, "--target-bits", "5.5"]
    for dry_run in ([], ["--dry-run"]):
        proc = quantkit("gguf", TINY, tmp_path / "out", *flags, "--samples", "8", "--seq-len", "128", *dry_run)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert words in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_gguf_floor_counts_the_bulk_type_its_fallbacks_and_types_below_it() -> None:
    """The least a mix spends, from shapes alone: the bulk type's bits per weight (Q4_K: 4.5), a row that is not
    whole 256-weight blocks at llama.cpp's fallback (Q5_0: 5.5), one that is not whole 32-weight blocks at F16, and
    IQ3_XS at the IQ3_XXS its mix gives attention and middle FFNs; only block matrices count."""
    from quantkit.producers.gguf import convert, target_bits

    def t(name: str, *shape: int) -> convert.Tensor:
        return convert.Tensor(name, shape, "F16")

    even = [t("blk.0.attn_q.weight", 256, 256), t("blk.0.attn_norm.weight", 256), t("output.weight", 8192, 100)]
    assert target_bits.floor_bits("Q4_K_M", even) == 4.5
    assert target_bits.floor_bits("Q4_K_M", [*even, t("blk.1.attn_q.weight", 256, 576)]) == (4.5 + 5.5 * 2.25) / 3.25
    assert target_bits.floor_bits("Q4_K_M", [t("blk.0.ffn_up.weight", 64, 100)]) == 16.0
    assert target_bits.floor_bits("IQ3_XS", even) == 3.0625  # IQ3_XXS, not the bulk IQ3_S's 3.4375
