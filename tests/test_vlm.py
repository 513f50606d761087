"""Vision-language models through the compressed-tensors methods, end to end on tiny checkpoints of three families.

Each family (tests/vlm_models.py: LLaVA with the reference model's trained text weights, Qwen2.5-VL, Gemma 3) is
quantized through the CLI with real llm-compressor and real calibration, and the test reads what is on disk: the
language model's every Linear quantized, the vision tower and projector byte for byte the source's (the manifest's
``quantization.vision``), the ignore list in both spellings; then transformers loads the artifact as the class
the source names and answers an image prompt. Failures are provoked for real: a changed vision tensor fails the
check; image calibration on a text model, or an unknown vision-language architecture, exits 2 in one line.

What runs, to stay affordable on a shared 2-core CPU: every method and layout on LLaVA; on Qwen2.5-VL and Gemma 3
the methods whose path differs (AWQ's and SmoothQuant's mappings scoped to the language model, GPTQ's sequential
pipeline, data-free FP8), and an image+text calibration of each family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
from safetensors import safe_open  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from quantkit import images  # noqa: E402
from quantkit.architectures import vision_language  # noqa: E402
from quantkit.cli.main import app  # noqa: E402
from quantkit.errors import BackendError  # noqa: E402
from quantkit.producers import vision  # noqa: E402
from quantkit.source import vet  # noqa: E402

from conftest import quantkit  # noqa: E402
from vlm_models import make_vlm  # noqa: E402

CALIB = ["--samples", "4", "--seq-len", "128"]
TEXT_LINEARS = 8 * 7  # 8 decoder layers x (q, k, v, o, gate, up, down)
ARTIFACTS: dict[str, tuple[str, list[str]]] = {
    "llava-awq": ("llava", ["awq", *CALIB]),
    "llava-gptq": ("llava", ["gptq", *CALIB]),
    "llava-autoround": ("llava", ["autoround", "--iterations", "4", *CALIB]),
    "llava-rtn": ("llava", ["rtn"]),
    "llava-fp8": ("llava", ["fp8", *CALIB]),
    "llava-fp8-dynamic": ("llava", ["fp8", "--scheme", "dynamic"]),
    "llava-fp8-block": ("llava", ["fp8", "--scheme", "block"]),
    "llava-int8": ("llava", ["int8", *CALIB]),
    "llava-w4a8": ("llava", ["w4a8", *CALIB]),
    "llava-autoawq": ("llava", ["awq", "--format", "autoawq", *CALIB]),
    "llava-gptq-layout": ("llava", ["gptq", "--format", "gptq", *CALIB]),
    "qwen-awq": ("qwen2_5_vl", ["awq", *CALIB]),
    "qwen-gptq": ("qwen2_5_vl", ["gptq", *CALIB]),
    "qwen-int8": ("qwen2_5_vl", ["int8", *CALIB]),
    "qwen-fp8-dynamic": ("qwen2_5_vl", ["fp8", "--scheme", "dynamic"]),
    "gemma-awq": ("gemma3", ["awq", *CALIB]),
    "gemma-gptq": ("gemma3", ["gptq", *CALIB]),
    "gemma-fp8": ("gemma3", ["fp8", *CALIB]),
    "llava-gptq-images": ("llava", ["gptq", *CALIB, "--calib-images", "shipped"]),
    "qwen-gptq-images": ("qwen2_5_vl", ["gptq", *CALIB, "--calib-images", "shipped"]),
    "gemma-gptq-images": ("gemma3", ["gptq", *CALIB, "--calib-images", "shipped"]),
}
COMPRESSED = [n for n, (_, args) in ARTIFACTS.items() if "--format" not in args]

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-src")
    made: dict[str, Path] = {}

    def _make(family: str) -> Path:
        if family not in made:
            made[family] = make_vlm(family, root / family)
        return made[family]

    return _make


@pytest.fixture(scope="module")
def build(tmp_path_factory, checkpoint):
    """Build an artifact through the CLI (in process) once per module; returns (folder, its manifest)."""
    root = tmp_path_factory.mktemp("vlm-out")
    done: dict[str, tuple[Path, dict]] = {}

    def _build(name: str) -> tuple[Path, dict]:
        if name not in done:
            family, (verb, *flags) = ARTIFACTS[name][0], ARTIFACTS[name][1]
            out = root / name
            res = CliRunner().invoke(app, [verb, str(checkpoint(family)), str(out), *flags, "--json"])
            assert res.exit_code == 0, f"quantkit {verb} {family} failed:\n{res.output}\n{res.stderr}"
            done[name] = (out, json.loads((out / "quantkit.json").read_text()))
        return done[name]

    return _build


def tensors(folder: Path) -> dict[str, Any]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out |= {k: fh.get_tensor(k) for k in fh.keys()}
    return out


def _image_answer(folder: Path, family: str) -> str:
    """transformers loads the artifact as the source's class and answers an image prompt greedily."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.to(torch.float32)  # transformers leaves a compressed Qwen2.5-VL's body in bf16 (the transformers engine)
    assert type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    inputs, _ = images.prompt_inputs(folder, images.load(limit=1)[0])
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6
    return transformers.AutoTokenizer.from_pretrained(str(folder)).decode(out[0, inputs["input_ids"].shape[1]:])


@pytest.mark.parametrize("name", COMPRESSED)
def test_language_model_quantized_vision_kept(name, build, checkpoint):
    folder, manifest = build(name)
    family = ARTIFACTS[name][0]
    src = checkpoint(family)
    q = manifest["quantization"]
    vl = vision_language(json.loads((src / "config.json").read_text()))
    # Every Linear of the language model, and nothing else, was quantized.
    assert q["coverage"] == {"expected": TEXT_LINEARS, "quantized": TEXT_LINEARS}
    # The vision side is the source's, tensor for tensor (the producer's own check, read back here).
    before, after = tensors(src), tensors(folder)
    kept = sorted(k for k in before if vl.kept(k))
    assert kept and q["vision"]["tensors"] == len(kept) and q["vision"]["unchanged"] is True
    assert sorted(k for k in after if vl.kept(k)) == kept
    assert all(torch.equal(before[k], after[k]) for k in kept)
    # The language model's weights are quantized on disk (packed ints or 8-bit floats with scales).
    text = [k for k in after if not vl.kept(k) and "layers.0.self_attn.q_proj" in k]
    assert any(k.endswith("weight_scale") for k in text), text
    # Both spellings of the kept modules are in the ignore list, so transformers keeps what vLLM keeps.
    ignore = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
    assert any(i.startswith("model.") and vl.kept(i + ".weight") for i in ignore)
    assert any(not i.startswith("model.") and vl.kept(i + ".weight") for i in ignore)
    assert set(vl.ignore_patterns()) <= set(ignore)  # and as patterns (vLLM nests Gemma 3's tower further)
    assert all((folder / f).is_file() for f in vision.PROCESSOR_FILES if (src / f).is_file())
    assert _image_answer(folder, family).strip()


@pytest.mark.parametrize("name,layout", [("llava-autoawq", "autoawq"), ("llava-gptq-layout", "gptq")])
def test_legacy_layouts_keep_the_vision_tower(name, layout, build, checkpoint):
    folder, _ = build(name)
    folder = folder / layout  # the legacy layout beside the compressed-tensors checkpoint it is made from
    vl = vision_language(json.loads((checkpoint("llava") / "config.json").read_text()))
    before, after = tensors(checkpoint("llava")), tensors(folder)
    kept = sorted(k for k in before if vl.kept(k))
    assert sorted(k for k in after if vl.kept(k)) == kept
    # The legacy layouts are float16 throughout (their kernels' dtype): the vision side is the source's, cast.
    assert all(after[k].dtype == torch.float16 and torch.equal(before[k].to(torch.float16), after[k]) for k in kept)
    assert any(k.endswith("qweight") for k in after)
    assert all((folder / f).is_file() for f in vision.PROCESSOR_FILES if (checkpoint("llava") / f).is_file())


@pytest.mark.parametrize("name", ["llava-gptq-images", "qwen-gptq-images", "gemma-gptq-images"])
def test_image_calibration_is_recorded(name, build):
    _, manifest = build(name)
    cal = manifest["calibration"]
    shipped = images.load()
    assert cal["images"] == len(shipped) and cal["images_source"] == "shipped"
    assert cal["images_sha256"] == images.sha256(shipped)
    assert manifest["quantization"]["coverage"]["quantized"] == TEXT_LINEARS


@pytest.mark.unit
def test_images_hash_covers_their_bytes(tmp_path):
    folder = tmp_path / "images"
    shutil.copytree(images.SHIPPED, folder)
    before = images.sha256(images.load(folder))
    assert before == images.sha256(images.load())
    png = sorted(folder.glob("*.png"))[0]
    png.write_bytes(png.read_bytes() + b"\0")
    assert images.sha256(images.load(folder)) != before


def test_changed_vision_tensor_fails_the_check(build, checkpoint, tmp_path):
    folder, _ = build("llava-rtn")
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    from safetensors.torch import save_file

    state = tensors(copy)
    name = next(k for k in state if k.startswith("vision_tower.") and k.endswith("q_proj.weight"))
    state[name] = state[name] + 1
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    vl = vision_language(json.loads((checkpoint("llava") / "config.json").read_text()))
    with pytest.raises(BackendError, match=r"1 changed: " + name.replace(".", r"\.")):
        vision.check_kept(vet(checkpoint("llava")), copy, vl)


def test_eval_scores_image_prompts(build, checkpoint):
    folder, _ = build("llava-awq")
    res = CliRunner().invoke(app, ["eval", str(folder), "--max-tokens", "512", "--json"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((folder / "quantkit.json").read_text())
    img = manifest["evaluation"]["results"][0]["images"]
    assert img["scored"] and img["prompts"] == 4 and img["answer_tokens"] == 64
    assert 0 < img["kld"] < 5 and 0 < img["top1"] <= 1
    assert img["images_sha256"] == images.sha256(images.load(limit=4))


def test_image_prompts_of_the_source_against_itself_are_exact(checkpoint):
    """The baseline against its own weights: KLD 0 and top-1 1, or the inputs differ between the two passes."""
    from quantkit.evaluation import images as image_eval

    src = checkpoint("qwen2_5_vl")
    base = image_eval.baseline(src, "cpu", 2, answer_tokens=4)
    assert base.reason is None and "PIL" in base.built_by  # no torchvision here: Qwen's processor path
    got = image_eval.score(src, base, "cpu")
    assert got["kld"] < 1e-6 and got["top1"] == 1.0


def test_refusals_in_one_line(tmp_path, checkpoint, tiny):
    r = quantkit("gptq", str(tiny), str(tmp_path / "a"), "--calib-images", "shipped", "--samples", "4")
    assert r.returncode == 2 and "is not a vision-language model" in r.stderr and "Traceback" not in r.stderr
    odd = tmp_path / "odd"
    shutil.copytree(checkpoint("llava"), odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["FooVisionForConditionalGeneration"]
    (odd / "config.json").write_text(json.dumps(cfg))
    r = quantkit("rtn", str(odd), str(tmp_path / "b"))
    assert r.returncode == 2 and "vision-language families of its architecture table" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.unit
def test_doctor_refuses_llava_in_vllm_026_with_transformers_517():
    """The skew measured on the H200: vLLM 0.26's LLaVA family cannot be inspected with transformers 5.17."""
    from quantkit.engines import doctor

    skew = doctor.VERSION_SKEWS[0]
    bad = {"vllm": "0.26.0", "transformers": "5.17.0"}
    found = skew.check("vllm", bad, "LlavaForConditionalGeneration")
    assert found is not None and found.status == "fail" and "PixtralRotaryEmbedding" in found.message
    assert skew.check("vllm", bad, "Qwen2_5_VLForConditionalGeneration") is None
    assert skew.check("vllm", {"vllm": "0.26.0", "transformers": "5.16.2"}, "LlavaForConditionalGeneration") is None
    assert skew.check("vllm", {"vllm": "0.27.0", "transformers": "5.17.0"}, "LlavaForConditionalGeneration") is None
    assert skew.check("sglang", bad, "LlavaForConditionalGeneration") is None

