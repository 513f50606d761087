"""Image prompts: how far a quantized vision-language model's answers about images move from the source model's.

Text perplexity and KLD score the language model alone; a vision-language artifact must also still read images
through a vision tower it kept and a language model it quantized. For each of a few shipped images
(:mod:`quantkit.images`) the baseline (the source, bf16) answers a question greedily; then the artifact is given
the same image, question and the baseline's answer, and its next-token distributions over the answer tokens are
compared with the baseline's: KLD (exact: transformers gives whole distributions) and top-1 agreement, averaged
over every answer token of every prompt. Both models see identical inputs (the same processor output), so the
only difference is the weights.

The inputs come from :func:`quantkit.images.prompt_inputs` (the checkpoint's own processor, or its PIL image
processor and tokenizer where the processor needs torchvision), said in the record. Anything that stops the prompts
is recorded as the reason they were not scored, never skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit import images as images_mod
from quantkit.architectures import vision_language
from quantkit.checkpoint import read_config

ANSWER_TOKENS = 16
DEFAULT_PROMPTS = 4


@dataclass
class Prompt:
    """One image prompt: the model inputs (prompt + the baseline's answer) and where the answer starts."""

    picture: images_mod.Picture
    inputs: dict[str, Any]  # tensors: input_ids (prompt + answer), attention_mask, pixel_values...
    answer_start: int
    answer: str
    placeholder_ids: list[int]  # the prompt with its image as one placeholder, then the answer (for vLLM)


@dataclass
class BaselineImages:
    """The baseline's answers and its log-probabilities over them, or why the prompts could not be built."""

    prompts: list[Prompt]
    logprobs: list[Any]  # per prompt: [answer tokens, vocab] float32 log-probabilities
    built_by: str
    question: str
    reason: str | None = None  # set when no prompt could be built (then prompts is empty)

    def manifest_base(self) -> dict[str, Any]:
        return {"question": self.question, "prompts": len(self.prompts), "built_by": self.built_by,
                "images_sha256": images_mod.sha256([p.picture for p in self.prompts]) if self.prompts else None,
                "answers": [{"image": p.picture.path.name, "answer": p.answer} for p in self.prompts]}


def is_vision_language(path: Path) -> bool:
    return vision_language(read_config(path)) is not None


def _load(path: Path, device: str, dtype: Any) -> Any:
    import torch
    import transformers

    from quantkit.engines.transformers.logits import all_float32

    model = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
    if dtype is torch.float32:  # a compressed-tensors checkpoint may load partly in bf16 (the transformers engine)
        all_float32(model)
    return model.to(device).eval()


def baseline(path: Path, device: str, n_prompts: int = DEFAULT_PROMPTS, question: str = images_mod.QUESTION,
             answer_tokens: int = ANSWER_TOKENS) -> BaselineImages:
    """The baseline's greedy answers to ``n_prompts`` shipped images and its log-probabilities over them."""
    import torch

    pictures = images_mod.load(limit=n_prompts)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    built_by = "its processor"
    prompts: list[Prompt] = []
    try:
        raw = []
        for pic in pictures:
            inputs, built_by = images_mod.prompt_inputs(path, pic, question)
            raw.append((pic, inputs))
    except Exception as e:  # a processor that cannot be built: recorded as the reason, never a crash of eval
        return BaselineImages([], [], built_by, question, reason=f"{type(e).__name__}: {str(e).strip()[:200]}")
    model = _load(path, device, dtype)
    try:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        logprobs = []
        for pic, inputs in raw:
            start = inputs["input_ids"].shape[1]
            with torch.inference_mode():
                out = model.generate(**{k: v.to(device) for k, v in inputs.items()}, max_new_tokens=answer_tokens,
                                     do_sample=False, min_new_tokens=answer_tokens)
            ids = out[:, :start + answer_tokens].cpu()
            full = images_mod.extend(inputs, ids[:, start:])  # the answer appended as text
            answer = ids[0, start:].tolist()
            plain = tok(images_mod.prompt_text(path, question), add_special_tokens=False)["input_ids"] + answer
            prompts.append(Prompt(pic, full, start, tok.decode(answer, skip_special_tokens=True), plain))
            logprobs.append(_answer_logprobs(model, full, start, device))
    finally:
        del model
    return BaselineImages(prompts, logprobs, built_by, question)


def _answer_logprobs(model: Any, inputs: dict[str, Any], start: int, device: str) -> Any:
    """Log-probabilities of the positions that predict the answer tokens: [answer tokens, vocab]."""
    import torch

    with torch.inference_mode():
        out = model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False)
    return out.logits[0, start - 1:-1].float().log_softmax(-1).cpu()


def score(path: Path, base: BaselineImages, device: str) -> dict[str, Any]:
    """The artifact's KLD and top-1 over the baseline's answers (the manifest's ``evaluation.images`` record)."""
    import torch

    record = base.manifest_base()
    if base.reason:
        return record | {"scored": False, "reason": base.reason}
    model = _load(path, device, torch.float32 if device == "cpu" else "auto")
    try:
        klds, agree, n = 0.0, 0, 0
        for prompt, lp_base in zip(base.prompts, base.logprobs, strict=True):
            lp = _answer_logprobs(model, prompt.inputs, prompt.answer_start, device)
            klds += float((lp_base.exp() * (lp_base - lp)).sum(-1).sum())
            agree += int((lp.argmax(-1) == lp_base.argmax(-1)).sum())
            n += lp.shape[0]
    finally:
        del model
    return record | {"scored": True, "answer_tokens": n, "kld": round(klds / n, 6), "top1": round(agree / n, 4),
                     "kld_method": "exact (whole distributions, transformers)"}


def score_vllm(path: Path, base: BaselineImages, options: Any) -> dict[str, Any]:
    """The artifact's KLD and top-1 over the baseline's answers in vLLM: each prompt goes in with its image as one
    placeholder, which vLLM's own processor expands, and the answer's positions come back as vLLM's top-k, so the
    KLD is a lower bound (the text evaluation's bins) and top-1 is exact."""
    from quantkit.engines import logits as engines
    from quantkit.formats.names import VLLM
    from quantkit.evaluation.metrics import BaselineWindow, kld_rows

    record = base.manifest_base()
    if base.reason:
        return record | {"scored": False, "reason": base.reason}
    engine = engines.open_engine(VLLM, path, options)
    try:
        got = engine.image_logprobs([(p.placeholder_ids, p.picture.path, p.inputs["input_ids"].shape[1] - p.answer_start)
                                     for p in base.prompts])
    finally:
        engine.close()
    klds, agree, n = 0.0, 0, 0
    for lp_base, lp in zip(base.logprobs, got, strict=True):
        dense = lp_base.numpy()
        bw = BaselineWindow(argmax=dense.argmax(-1), dense=dense)
        klds += float(kld_rows(bw, lp).sum())
        agree += int((lp.ids[:, 0] == bw.argmax).sum())
        n += len(bw.argmax)
    return record | {"scored": True, "answer_tokens": n, "kld": round(klds / n, 6), "top1": round(agree / n, 4),
                     "kld_method": f"lower bound: vLLM's top-{options.topk} log-probabilities as bins plus one bin "
                                   "for the rest of the vocabulary; the image expanded by vLLM's processor"}

