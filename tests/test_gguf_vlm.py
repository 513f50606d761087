"""GGUF of vision-language models: the text model and its mmproj file, served by llama-server with an image.

Per family llama.cpp converts (tests/vlm_models.py's Qwen2.5-VL and Gemma 3), the real CLI makes a Q8_0 artifact
and the test reads it back: the text GGUF and ``mmproj/mmproj-*-F16.gguf``, both in the manifest with their
sha256 and the mmproj named as such; the vision tensors are the source's (read with gguf-py, compared with the
safetensors to F16 rounding, the converter's own transformations included: Qwen's fused qkv and 3-D patch
convolution split, Gemma's projector norm shifted by one); llama.cpp's image embeddings (its mtmd library through
llama-cpp-python, the mmproj with the text model) equal transformers' ``get_image_features``; ``quantkit smoke``
starts llama-server with ``--mmproj`` and its answer to an image question is not empty and counted the image's
tokens, transformers' answer recorded beside it. Eval of the text model runs in llama.cpp as for any GGUF, and an
importance matrix covers the language model only. LLaVA (a CLIP tower, which llama.cpp's converter does not
convert) exits 2 in one line, nothing written.

Every vision tensor of the checkpoints is moved by seeded noise first: transformers' initialisation leaves biases
at 0 and norms at 1 (a mis-mapped one would not show), and Gemma 3's projector weight at zero, which makes every
image embedding zero.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")
from llama_cpp import mtmd_cpp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from quantkit import images  # noqa: E402

from vlm_models import make_vlm  # noqa: E402

pytestmark = pytest.mark.e2e

FAMILIES = ("qwen2_5_vl", "gemma3")
VISION = ("vision_tower.", "multi_modal_projector.", "visual.")
# (GGUF tensor, source tensor, how the converter derives it) per family: a few of every kind.
TENSORS: dict[str, list[tuple[str, str, Callable[[Any], Any]]]] = {
    "qwen2_5_vl": [
        ("v.blk.0.attn_q.weight", "visual.blocks.0.attn.qkv.weight", lambda t: t[:64]),
        ("v.blk.1.attn_v.bias", "visual.blocks.1.attn.qkv.bias", lambda t: t[128:]),
        ("v.blk.0.ffn_down.weight", "visual.blocks.0.mlp.down_proj.weight", lambda t: t),
        ("v.blk.1.ln2.weight", "visual.blocks.1.norm2.weight", lambda t: t),
        ("v.patch_embd.weight", "visual.patch_embed.proj.weight", lambda t: t[:, :, 0]),
        ("v.patch_embd.weight.1", "visual.patch_embed.proj.weight", lambda t: t[:, :, 1]),
        ("mm.0.weight", "visual.merger.mlp.0.weight", lambda t: t),
        ("mm.2.bias", "visual.merger.mlp.2.bias", lambda t: t),
    ],
    "gemma3": [
        ("v.blk.0.attn_q.weight", "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight", lambda t: t),
        ("v.blk.1.ffn_up.bias", "vision_tower.vision_model.encoder.layers.1.mlp.fc1.bias", lambda t: t),
        ("v.patch_embd.weight", "vision_tower.vision_model.embeddings.patch_embedding.weight", lambda t: t),
        ("v.position_embd.weight", "vision_tower.vision_model.embeddings.position_embedding.weight", lambda t: t),
        ("v.post_ln.bias", "vision_tower.vision_model.post_layernorm.bias", lambda t: t),
        ("mm.input_projection.weight", "multi_modal_projector.mm_input_projection_weight", lambda t: t),
        ("mm.soft_emb_norm.weight", "multi_modal_projector.mm_soft_emb_norm.weight", lambda t: t + 1),
    ],
}
# Image sides each engine takes without resizing: Gemma 3's 64 x 64 input; for Qwen2.5-VL 112 x 112 (16 merged
# patches: llama.cpp asks at least 8), given to transformers' processor with that many pixels allowed.
SIDE = {"qwen2_5_vl": 112, "gemma3": 64}


def _stirred(family: str, path: Path) -> Path:
    """A ``family`` checkpoint whose vision tensors are moved by seeded noise (see the module docstring)."""
    make_vlm(family, path)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(1)
    for name, t in state.items():
        if name.startswith(VISION):
            state[name] = (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def made(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cli: Callable) -> dict:
    """One family's checkpoint and its Q8_0 artifact, made by the CLI."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    src = _stirred(family, root / family)
    out = root / "gguf"
    cli("gguf", src, out, "-t", "Q8_0", check=True)
    return {"family": family, "src": src, "out": out, "manifest": json.loads((out / "quantkit.json").read_text())}


def _mmproj(made: dict) -> Path:
    return made["out"] / made["manifest"]["quantization"]["mmproj"]["file"]


def test_artifact_holds_the_text_model_and_its_mmproj(made: dict) -> None:
    out, m, name = made["out"], made["manifest"], made["family"]
    text, vision = out / f"{name}-Q8_0.gguf", out / "mmproj" / f"mmproj-{name}-F16.gguf"
    assert sorted(out.glob("*.gguf")) == [text]  # eval and smoke take the folder's own .gguf: the text model
    assert _mmproj(made) == vision
    for f in (text, vision):
        assert m["files"][f.relative_to(out).as_posix()]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    record = m["quantization"]["mmproj"]
    assert record["type"] == "F16" and record["why"]
    assert record["projector"] == {"qwen2_5_vl": "qwen2.5vl_merger", "gemma3": "gemma3"}[name]
    reader = gguf.GGUFReader(vision)
    kind = reader.fields["general.type"]
    assert bytes(kind.parts[kind.data[0]]).decode() == "mmproj"
    assert len(reader.tensors) == record["tensors"]
    assert not any(t.name.startswith(("v.", "mm.")) for t in gguf.GGUFReader(text).tensors)


def test_mmproj_tensors_are_the_sources(made: dict) -> None:
    source = load_file(str(made["src"] / "model.safetensors"))
    written = {t.name: t for t in gguf.GGUFReader(_mmproj(made)).tensors}
    for gguf_name, hf_name, derive in TENSORS[made["family"]]:
        t = written[gguf_name]
        want = derive(source[hf_name].float()).numpy()
        kind = {"F16": np.float16, "F32": np.float32}[t.tensor_type.name]
        got = np.asarray(t.data).reshape(want.shape)
        np.testing.assert_array_equal(got, want.astype(kind), err_msg=f"{gguf_name} is not {hf_name}")


def _llama_embeddings(text: Path, mmproj: Path, image: Any) -> np.ndarray:
    """llama.cpp's embeddings of ``image`` (mtmd: the mmproj beside the text model), one row per image token."""
    L = llama_cpp
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # no AMX repacking (tests/test_gguf.py says why)
    model = L.llama_model_load_from_file(str(text).encode(), mp)
    assert model, f"llama.cpp could not load {text}"
    params = mtmd_cpp.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
    ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), model, params)
    assert ctx, f"llama.cpp could not load {mmproj}"
    chunks = mtmd_cpp.mtmd_input_chunks_init()
    try:
        data = np.asarray(image, dtype=np.uint8).tobytes()
        pixels = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd_cpp.mtmd_bitmap_init(image.width, image.height, pixels)
        prompt = mtmd_cpp.mtmd_input_text()
        prompt.text = mtmd_cpp.mtmd_default_marker()
        prompt.text_len, prompt.add_special, prompt.parse_special = len(prompt.text), False, True
        assert mtmd_cpp.mtmd_tokenize(ctx, chunks, ctypes.byref(prompt), (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap),
                                      1) == 0
        mtmd_cpp.mtmd_bitmap_free(bitmap)
        n_embd = L.llama_model_n_embd(model)
        for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
            chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
            if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                n = mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk)
                assert mtmd_cpp.mtmd_encode_chunk(ctx, chunk) == 0
                out = mtmd_cpp.mtmd_get_output_embd(ctx)
                return np.ctypeslib.as_array(out, shape=(n * n_embd,)).reshape(n, n_embd).copy()
        raise AssertionError("mtmd made no image chunk")
    finally:
        mtmd_cpp.mtmd_input_chunks_free(chunks)
        mtmd_cpp.mtmd_free(ctx)
        L.llama_model_free(model)


def _transformers_embeddings(family: str, src: Path, image: Any) -> np.ndarray:
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        if family == "qwen2_5_vl":
            pixels = image.width * image.height
            proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(src), min_pixels=pixels,
                                                                         max_pixels=pixels)
            enc = proc(images=[image], return_tensors="pt")
            out = model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"])
        else:
            enc = transformers.AutoProcessor.from_pretrained(str(src)).image_processor(images=[image],
                                                                                      return_tensors="pt")
            out = model.model.get_image_features(pixel_values=enc["pixel_values"])
    feats = getattr(out, "pooler_output", out)
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    return feats.reshape(-1, feats.shape[-1]).float().numpy()


def test_llamacpp_image_embeddings_equal_transformers(made: dict) -> None:
    family = made["family"]
    side = SIDE[family]
    image = images.load()[2].open().resize((side, side))
    got = _llama_embeddings(made["out"] / f"{family}-Q8_0.gguf", _mmproj(made), image)
    want = _transformers_embeddings(family, made["src"], image)
    assert got.shape == want.shape
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert rel < 0.02, f"llama.cpp's image embeddings are {rel:.4f} (relative) from transformers'"


def test_llama_server_answers_an_image_question(made: dict, cli: Callable) -> None:
    res = cli("smoke", made["out"], "--baseline", "source", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout)["runs"][0]
    assert run["status"] == "passed"
    assert "--mmproj" in run["command"] and str(_mmproj(made)) in run["command"]
    asked = run["image"]
    assert asked["text"].strip() and asked["image"] == images.load()[0].path.name
    assert asked["image_tokens"] > 0
    assert asked["baseline"]["compared"] > 0 and asked["baseline"]["baseline_text"].strip()
    recorded = json.loads((made["out"] / "quantkit.json").read_text())["smoke"]["runs"]
    assert recorded[f"llama.cpp:{made['family']}-Q8_0.gguf"]["image"]["text"] == asked["text"]


def test_smoke_asks_about_the_image_it_is_given(made: dict, cli: Callable, tmp_path: Path) -> None:
    """--image and --image-prompt reach the image question; a file that is no image is refused before a server."""
    pic = images.load()[3]
    res = cli("smoke", made["out"], "--image", pic.path, "--image-prompt", "What shapes are there?", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    asked = json.loads(res.stdout)["runs"][0]["image"]
    assert asked["image"] == pic.path.name and asked["question"] == "What shapes are there?"
    assert asked["image_sha256"] == pic.sha256
    bad = tmp_path / "notes.txt"
    bad.write_text("not a picture")
    res = cli("smoke", made["out"], "--image", bad)
    assert res.returncode == 2 and "is not an image file" in res.stderr and "Traceback" not in res.stderr


def test_eval_scores_the_text_model_in_llamacpp(made: dict, cli: Callable) -> None:
    res = cli("eval", made["out"], "--dataset", "heldout", "--ctx", "256", "--max-tokens", "1024", "--json")
    doc = json.loads(res.stdout)
    (result,) = doc["results"]
    assert result["engine"]["engine"] == "llama.cpp" and result["tokens"] == 1024
    # the random text models' next-token distributions are flat (perplexity above the vocabulary's size), so top-1
    # moves with any rounding; Q8_0's KLD and perplexity are what show the text model is the source's
    assert result["kld"] < 0.05 and abs(result["ppl_ratio"] - 1) < 0.01, result


def test_importance_matrix_covers_the_language_model(tmp_path: Path, cli: Callable) -> None:
    src = make_vlm("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    out = tmp_path / "gguf"
    cli("gguf", src, out, "-t", "Q4_K_M", "--imatrix", "--samples", "4", "--seq-len", "128", check=True)
    m = json.loads((out / "quantkit.json").read_text())
    entries = gguf.GGUFReader(out / m["quantization"]["imatrix"]["file"]).tensors
    names = {t.name.rsplit(".", 1)[0] for t in entries}
    assert m["quantization"]["imatrix"]["entries"] == 8 * 7  # 8 layers x (q, k, v, o, gate, up, down)
    assert all(n.startswith("blk.") for n in names), sorted(names)[:5]
    assert (out / m["quantization"]["mmproj"]["file"]).is_file()


def test_llava_clip_tower_is_refused(tmp_path: Path, cli: Callable) -> None:
    src = make_vlm("llava", tmp_path / "llava")
    out = tmp_path / "gguf"
    res = cli("gguf", src, out, "-t", "Q8_0")
    assert res.returncode == 2, res.stderr
    first = res.stderr.strip().splitlines()[0]
    assert "vision side (mmproj) of LlavaForConditionalGeneration" in first and "clip_vision_model" in first
    assert not out.exists()
