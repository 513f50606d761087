"""Small vision-language checkpoints of several families, made by transformers, for tests.

``make_vlm(family, path)`` writes a bf16 checkpoint with transformers' own ``save_pretrained``, its processor
(image processor, tokenizer with the family's image tokens, chat template), so it loads like a released one in
transformers (``AutoModelForImageTextToText`` + ``AutoProcessor``), quantkit, llm-compressor, llama.cpp's converter
and vLLM:

* ``llava``: ``LlavaForConditionalGeneration`` (CLIP vision tower, two-layer projector, Llama text model);
* ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration`` (its own windowed ViT as ``model.visual``, patch merger,
  Qwen2 text model with multimodal rotary positions);
* ``gemma3``: ``Gemma3ForConditionalGeneration`` (SigLIP vision tower, pooled projector, Gemma 3 text model);

LLaVA's text model is Llama-shaped, so it carries the reference model's trained weights
(``models/quantkit-tiny``: its perplexity means something), with new rows for the image tokens; the others' text
models are random with a wide spread, so next-token predictions are not near-ties. Text widths are 256 (groups of
128 and K-quant blocks of 256 divide every quantized row); the vision towers are 64 wide with images of 64 x 64
(56 x 56 for Qwen's 14-pixel patches) so an image prompt is a few dozen tokens. The processors are the PIL ones
(no torchvision; Qwen2.5-VL's, which needs it, is written as files). The same arguments give the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "quantkit-tiny"
FAMILIES = ("llava", "qwen2_5_vl", "gemma3")
HUB_TOWER = ("llava", "gemma3")  # CLIP / SigLIP towers, whose released checkpoints say vision_tower.vision_model.*
HUB_TOWER_PREFIX = "vision_tower.vision_model."
VOCAB = 8256  # the reference tokenizer's 8,192 tokens + the image tokens, rounded up to 64

# Each family's image tokens, in the order they are added to the tokenizer.
_IMAGE_TOKENS = {
    "llava": ["<image>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
}
# Chat templates that render OpenAI-style content lists (what vLLM and transformers' processors pass): the
# image's placeholder where the image part is, the text parts as they are.
_PLACEHOLDER = {
    "llava": "<image>\n",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}
_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '%PLACEHOLDER%' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TEXT = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=8, vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-5,
             bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, initializer_range=0.1)
_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)


def _tokenizer(family: str, tokenizer_from: Path) -> Any:
    from transformers import AutoTokenizer

    named = {"gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                        "image_token": "<image_soft_token>"}}.get(family)
    tok = AutoTokenizer.from_pretrained(tokenizer_from, **({"extra_special_tokens": named} if named else {}))
    tok.add_special_tokens({"additional_special_tokens": _IMAGE_TOKENS[family]},
                           replace_extra_special_tokens=False)
    if family == "gemma3":  # vLLM's Gemma 3 processor looks up runs of newlines as tokens, as Gemma's vocabulary has
        tok.add_tokens(["\n" * n for n in range(1, 5)])
    assert len(tok) <= VOCAB, len(tok)
    return tok


def _ids(tok: Any, family: str) -> dict[str, int]:
    return {t: tok.convert_tokens_to_ids(t) for t in _IMAGE_TOKENS[family]}


def _config(family: str, ids: dict[str, int]) -> Any:
    import transformers

    if family == "llava":
        return transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(**_TEXT),
            vision_config=transformers.CLIPVisionConfig(**_VISION, image_size=64, patch_size=16, projection_dim=64),
            image_token_index=ids["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default",
            projector_hidden_act="gelu", image_seq_length=16, tie_word_embeddings=False)
    if family == "qwen2_5_vl":
        text = {**_TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [8, 12, 12]}}
        return transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                           "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                           "out_hidden_size": 256, "fullatt_block_indexes": [1]},
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False)
    if family == "gemma3":
        text = {k: v for k, v in _TEXT.items() if k != "tie_word_embeddings"}
        return transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**text, sliding_window=512, query_pre_attn_scalar=64),
            vision_config=transformers.SiglipVisionConfig(**_VISION, image_size=64, patch_size=16, vision_use_head=False),
            mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
            image_token_index=ids["<image_soft_token>"], tie_word_embeddings=False)
    raise ValueError(f"unknown vision-language family {family!r}; choose from {', '.join(FAMILIES)}")


def _processor(family: str, tok: Any) -> Any:
    import transformers

    template = _TEMPLATE.replace("%PLACEHOLDER%", _PLACEHOLDER[family])
    if family == "llava":
        image = transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
        return transformers.LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=16,
                                           vision_feature_select_strategy="default", chat_template=template,
                                           image_token="<image>", num_additional_image_tokens=1)
    if family == "gemma3":
        image = transformers.Gemma3ImageProcessor(size={"height": 64, "width": 64})
        return transformers.Gemma3Processor(image_processor=image, tokenizer=tok, chat_template=template,
                                            image_seq_length=4)
    raise ValueError(family)


def _save_qwen_processor(path: Path, tok: Any) -> None:
    """Qwen2.5-VL's processor files, written without building the processor: its video processor needs torchvision,
    which has no CPU build on PyPI (the H200's image has it, and vLLM loads these files there)."""
    import transformers

    pixels = {"min_pixels": 56 * 56, "max_pixels": 56 * 56, "patch_size": 14, "merge_size": 2,
              "temporal_patch_size": 2}
    transformers.Qwen2VLImageProcessorPil(**pixels).save_pretrained(path)
    video = {**pixels, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor"}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    prep = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(prep | {"processor_class": "Qwen2_5_VLProcessor"},
                                                              indent=2))
    tok.chat_template = _TEMPLATE.replace("%PLACEHOLDER%", _PLACEHOLDER["qwen2_5_vl"])
    tok.save_pretrained(path)
    (path / "chat_template.jinja").write_text(tok.chat_template)


def _copy_reference_text(model: Any, tiny: Path) -> None:
    """Load the reference model's trained weights into a Llama-shaped text model (rows past 8,192 stay random)."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(tiny / "model.safetensors"))
    lm = model.model.language_model
    with torch.no_grad():
        for name, tensor in state.items():
            if name == "lm_head.weight":
                model.lm_head.weight[: tensor.shape[0]].copy_(tensor)
                continue
            target = lm.get_parameter(name.removeprefix("model."))
            if name.endswith("embed_tokens.weight"):
                target[: tensor.shape[0]].copy_(tensor)
            else:
                target.copy_(tensor)


def _hub_layout(path: Path) -> None:
    """Name the vision tower's tensors as released checkpoints do: ``vision_tower.vision_model.*``.

    transformers 5 strips the ``vision_model`` level of CLIP and SigLIP towers when it loads (its conversion
    mapping's ``PrefixChange``) and puts it back when it saves a model it loaded; a model made from a config has no
    load to undo, so ``save_pretrained`` writes ``vision_tower.embeddings.*``, which vLLM 0.26 cannot map ("There is
    no module or parameter named 'vision_tower.embeddings' in Gemma3ForConditionalGeneration", the H200 run of
    2026-12-02). Released LLaVA and Gemma 3 checkpoints carry the level, and so does a quantkit artifact of them."""
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    state = load_file(str(weights))
    renamed = {(HUB_TOWER_PREFIX + k[len("vision_tower."):]
                if k.startswith("vision_tower.") and not k.startswith(HUB_TOWER_PREFIX) else k): v
               for k, v in state.items()}
    save_file(renamed, str(weights), metadata={"format": "pt"})


def make_vlm(family: str, path: Path, *, seed: int = 0, tokenizer_from: Path = TINY, reuse: bool = False) -> Path:
    """Write a ``family`` checkpoint (one of :data:`FAMILIES`) with its processor to ``path``; return ``path``.
    ``reuse``: keep a checkpoint already there (GPU cases sharing one, built by whichever starts first)."""
    import torch
    import transformers

    if (path / "model.safetensors").is_file() and (path / "config.json").is_file() and reuse:
        return path
    tok = _tokenizer(family, tokenizer_from)
    config = _config(family, _ids(tok, family))
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).eval()
    if family == "llava":
        _copy_reference_text(model, tokenizer_from)
    if family == "gemma3":  # transformers initialises Gemma 3's projector at zero: every image would embed to zero
        with torch.no_grad():
            proj = model.model.multi_modal_projector.mm_input_projection_weight
            proj.normal_(0.0, proj.shape[0] ** -0.5)
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    if family in HUB_TOWER:
        _hub_layout(path)
    if family == "qwen2_5_vl":
        _save_qwen_processor(path, tok)
    else:
        _processor(family, tok).save_pretrained(path)
    gen = path / "generation_config.json"
    if gen.exists():  # greedy, as a smoke test compares answers
        cfg = json.loads(gen.read_text())
        cfg.update({"do_sample": False})
        gen.write_text(json.dumps(cfg, indent=2))
    return path


def test_image(size: int = 64, seed: int = 0) -> Any:
    """A deterministic RGB test image (a gradient with a square), as PIL."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    img = np.stack([x * 255 // size, y * 255 // size, np.full_like(x, 128)], -1).astype(np.uint8)
    a, b = sorted(rng.integers(0, size, 2))
    img[a:b, a:b] = rng.integers(0, 255, 3)
    return Image.fromarray(img)


test_image.__test__ = False  # a helper, not a pytest test
