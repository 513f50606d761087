"""The smoke test's image question: one picture and one question, the same for every engine that takes images.

An artifact whose server takes images (:meth:`quantkit.engines.serving.Server.takes_images`: a vision-language
checkpoint for vLLM, a GGUF with its mmproj file for llama-server) is asked about a picture after the text
questions: an OpenAI chat request whose user message holds an ``image_url`` part (the image as a ``data:`` URL,
:func:`quantkit.images.openai_message`) and the question, greedy like the others. It passes when

* the answer is not empty, and
* the image took prompt tokens: the same question without the image is sent too (one token asked), and the
  image request's ``prompt_tokens`` must be larger; a server that dropped the image would count the same.

The picture is the first of the shipped set (``calibration/images``, generated, with captions) unless the caller
names one. With a baseline, transformers answers the same picture and question greedily
(:func:`baseline_answer`: the checkpoint's own processor and chat template), and the served answer's leading
tokens are compared with it, recorded and never enforced: each engine resizes images its own way (llama.cpp's
Qwen2.5-VL asks for at least 8 image tokens where transformers' processor may give 4), so the two models need not
see the same pixels. transformers 5.17's ``AutoProcessor`` of Qwen2-VL and Qwen2.5-VL needs torchvision (for its
video processor); without it, their PIL image processor is used and the ``<|image_pad|>`` placeholder is expanded
here, as the processor would. A baseline that cannot be computed says why (``skipped``).

Tested with llama.cpp b11312's llama-server and transformers 5.17.0 on CPU; written for vLLM 0.26.0.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from quantkit import images
from quantkit.checkpoint import read_config
from quantkit.engines import client
from quantkit.errors import BackendError, UsageError

_QWEN_VL = ("qwen2_vl", "qwen2_5_vl")


def picture(path: Path | None) -> images.Picture:
    """The picture to ask about: ``path``, or the first of the shipped set."""
    if path is None:
        return images.load()[0]
    p = Path(path).expanduser()
    if not p.is_file() or p.suffix.lower() not in images.SUFFIXES:
        raise UsageError(f"image {p} is not an image file", hint=f"give a file ending {', '.join(images.SUFFIXES)}")
    return images.Picture(p, hashlib.sha256(p.read_bytes()).hexdigest())


def ask(url: str, greedy: dict[str, Any], pic: images.Picture, question: str, timeout: float) -> dict[str, Any]:
    """Ask the server about ``pic``; returns what it answered, or raises BackendError (empty answer, or an image
    that took no prompt tokens)."""
    answer = client.post_json(url + "/v1/chat/completions",
                              {**greedy, "messages": [images.openai_message(pic, question)]}, timeout=timeout)
    plain = client.post_json(url + "/v1/chat/completions",
                             {**greedy, "max_tokens": 1, "messages": [{"role": "user", "content": question}]},
                             timeout=timeout)
    choice = (answer.get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content") or ""
    with_image = (answer.get("usage") or {}).get("prompt_tokens")
    without = (plain.get("usage") or {}).get("prompt_tokens")
    record = {"image": pic.path.name, "image_sha256": pic.sha256, "caption": pic.caption, "question": question,
              "text": content, "finish_reason": choice.get("finish_reason"),
              "completion_tokens": (answer.get("usage") or {}).get("completion_tokens"), "prompt_tokens": with_image,
              "image_tokens": with_image - without if with_image is not None and without is not None else None}
    if not content.strip():
        raise BackendError(f"POST /v1/chat/completions with an image answered an empty message: {answer!r:.800}")
    if record["image_tokens"] is not None and record["image_tokens"] <= 0:
        raise BackendError(f"the image took no prompt tokens ({with_image} with it, {without} without): the server "
                           "did not see it", hint="check that the server loaded the model's vision side")
    return record


def baseline_answer(model: Any, tokenizer: Any, model_dir: Path, pic: images.Picture, question: str,
                    max_tokens: int, device: str) -> dict[str, Any]:
    """transformers' greedy answer to the picture and question (``model``: the checkpoint as
    ``AutoModelForImageTextToText``), or why it could not be computed (``skipped``)."""
    import torch

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    try:
        inputs, how = _inputs(model_dir, tokenizer, messages, pic.open())
    except _NoInputs as e:
        return {"image": pic.path.name, "question": question, "skipped": str(e)}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(next(model.parameters()).dtype)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=model.generation_config.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    ids = out[0, n:].tolist()
    return {"image": pic.path.name, "question": question, "processor": how, "prompt_tokens": n, "ids": ids,
            "text": tokenizer.decode(ids, skip_special_tokens=True)}


class _NoInputs(Exception):
    """transformers cannot prepare the image prompt here (the reason is the message)."""


def _inputs(model_dir: Path, tokenizer: Any, messages: list[dict[str, Any]], image: Any) -> tuple[dict[str, Any], str]:
    """The image prompt as the checkpoint's processor makes it (and which processor made it)."""
    import transformers

    try:
        proc = transformers.AutoProcessor.from_pretrained(str(model_dir))
    except ImportError as e:
        if read_config(model_dir).get("model_type") in _QWEN_VL:
            return _qwen_inputs(model_dir, tokenizer, messages, image), "Qwen2VLImageProcessorPil"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _NoInputs(f"transformers' processor does not load here: {first}") from None
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    return dict(enc), type(proc).__name__


def _qwen_inputs(model_dir: Path, tokenizer: Any, messages: list[dict[str, Any]], image: Any) -> dict[str, Any]:
    """Qwen2-VL's image prompt without its processor (which needs torchvision): the PIL image processor, and the
    ``<|image_pad|>`` placeholder repeated once per merged patch, as Qwen2VLProcessor expands it."""
    import transformers

    ip = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    enc = ip(images=[image], return_tensors="pt")
    pads = int(enc["image_grid_thw"].prod()) // (ip.merge_size ** 2)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if text.count("<|image_pad|>") != 1:
        raise _NoInputs("the chat template does not place one <|image_pad|> for the image")
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * pads), add_special_tokens=False,
                    return_tensors="pt")
    return {**dict(ids), "pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
