"""GGUF: convert real checkpoints, load the files in llama.cpp, and compare tokens and logits with transformers.

The reference model goes through the CLI; a small random model of every supported family (built from a
transformers config here, saved in bf16 so F16 holds its weights exactly) goes through the API. Logits come from
llama.cpp's own low-level API with an F32 KV cache, so an unquantized GGUF must match transformers to float
noise. Quantized files must load and stay close; the tensors that could not take a type are checked against
llama.cpp's fallback rules.

llama.cpp's AMX matmul (Sapphire Rapids and later CPUs) segfaults on quantized weights in llama-cpp-python
0.3.36 (ggml-org/llama.cpp#20824), and ``llama_cpp.Llama`` cannot turn that buffer type off, so logits are
computed with ``use_extra_bufts = False`` through the low-level bindings; tokenization uses
``llama_cpp.Llama(vocab_only=True)``.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from quantkit import api, recipe
from quantkit.errors import SourceModelError

pytestmark = pytest.mark.e2e

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "quantkit-tiny"


# ------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="session")
def heldout() -> list[str]:
    with gzip.open(ROOT / "calibration" / "heldout.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    """Logits for every position of ``ids`` from llama.cpp (F32 KV cache, no AMX repacking)."""
    L = llama_cpp
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp could not load {path}"
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = len(ids)
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(len(ids), 0, 1)
    try:
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        assert L.llama_decode(ctx, batch) == 0
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(ids), n_vocab)).copy()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


def llama_tokenize(path: Path, texts: list[str]) -> list[list[int]]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in texts]
    finally:
        llm.close()


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def kl(ref: np.ndarray, got: np.ndarray) -> float:
    p = torch.log_softmax(torch.from_numpy(ref), -1)
    q = torch.log_softmax(torch.from_numpy(got), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def top1(ref: np.ndarray, got: np.ndarray) -> float:
    return float((ref.argmax(-1) == got.argmax(-1)).mean())


def convert(model_dir: Path, out: Path, types: list[str]) -> api.ArtifactResult:
    r = recipe.load(None, {"model.source": str(model_dir), "output": str(out)},
                    base={"quantize": {"method": "gguf", "types": types}})
    return api.quantize(r)[0]


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


# ------------------------------------------------------------------------------------------------------------
# the reference model, through the CLI


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, cli: Callable) -> dict:
    out = tmp_path_factory.mktemp("gguf") / "tiny"
    proc = cli("gguf", TINY, out, "-t", "F16", "-t", "Q8_0", "-t", "Q4_K_M", "--json", check=True)
    result = json.loads(proc.stdout)[0]
    return {"path": out, "result": result, "manifest": json.loads((out / "quantkit.json").read_text())}


def test_reference_model_artifact(tiny_gguf: dict) -> None:
    out, q = tiny_gguf["path"], tiny_gguf["result"]["quantization"]
    assert sorted(p.name for p in out.iterdir()) == [
        "quantkit-tiny-F16.gguf", "quantkit-tiny-Q4_K_M.gguf", "quantkit-tiny-Q8_0.gguf", "quantkit.json"]
    assert q["types"] == ["F16", "Q8_0", "Q4_K_M"] and q["pre_tokenizer"] == "llama-bpe"
    # llama.cpp's converter does not know this locally trained vocabulary by its hash: quantkit named the splitter
    assert q["pre_tokenizer_from"] == "quantkit" and q["source_architecture"] == "LlamaForCausalLM"
    assert q["converter"]["commit"] == "0c1e57098" and q["converter"]["tool"] == "convert_hf_to_gguf.py"
    assert q["tokenizer"] == "gpt2" and q["architecture"] == "llama" and q["intermediate"] == "F16"
    assert q["fallbacks"] == {}  # every row of the reference model is a whole number of 256-value blocks
    assert tiny_gguf["manifest"]["kind"] == "gguf"
    types = tensor_types(out / "quantkit-tiny-Q4_K_M.gguf")
    assert {"Q4_K", "Q6_K"} <= set(types.values())  # llama.cpp's Q4_K_M mix, not a uniform type
    assert types["blk.0.attn_norm.weight"] == "F32"
    q8 = tensor_types(out / "quantkit-tiny-Q8_0.gguf")
    assert q8["blk.3.ffn_down.weight"] == "Q8_0" and q8["output_norm.weight"] == "F32"


def test_reference_tokenization_identical(tiny_gguf: dict, heldout: list[str]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    got = llama_tokenize(tiny_gguf["path"] / "quantkit-tiny-F16.gguf", heldout)
    want = [tok(t)["input_ids"] for t in heldout]
    assert sum(map(len, want)) > 100_000
    assert got == want


def test_reference_logits(tiny_gguf: dict, heldout: list[str]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    ids = tok(heldout[3])["input_ids"][:1024]
    ref = hf_logits(TINY, ids)
    f16 = llama_logits(tiny_gguf["path"] / "quantkit-tiny-F16.gguf", ids)
    assert top1(ref, f16) >= 0.999
    assert np.abs(ref - f16).max() < 0.05
    q8 = llama_logits(tiny_gguf["path"] / "quantkit-tiny-Q8_0.gguf", ids)
    q4 = llama_logits(tiny_gguf["path"] / "quantkit-tiny-Q4_K_M.gguf", ids)
    assert top1(ref, q8) >= 0.97 and kl(ref, q8) < 0.005
    assert top1(ref, q4) >= 0.85 and kl(ref, q4) < 0.05
    assert kl(ref, q8) < kl(ref, q4)


def test_only_requested_types_are_kept(tiny_gguf_q4_k_m: Path) -> None:
    assert sorted(p.name for p in tiny_gguf_q4_k_m.iterdir()) == ["quantkit-tiny-Q4_K_M.gguf", "quantkit.json"]
    quantization = json.loads((tiny_gguf_q4_k_m / "quantkit.json").read_text())["quantization"]
    assert quantization["intermediate"] == "BF16"  # lossless for the bf16 checkpoint


# ------------------------------------------------------------------------------------------------------------
# one small random model per family


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=8192, bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=512,
            initializer_range=0.1)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
FAMILIES = {
    # Llama 3.2-style: tied embeddings and Llama 3.1 rope scaling (rope_freqs tensor)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=500000.0,
                                                        rope_scaling=LLAMA31_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # q/k/v biases; more embedding rows than tokens, as real Qwen checkpoints have (transformers' Qwen2 tokenizer
    # adds <|endoftext|> after the reference vocabulary, which llama.cpp's converter wants an embedding row for)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, vocab_size=8256)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # a window shorter than the test sequence, so sliding attention is really exercised
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16)),
    # Gemma 3 4B+-style: linear rope scaling on the full-attention layers only, its own rope base on the others;
    # five sliding layers, then a full one (llama.cpp's fixed pattern; quantkit refuses others: architectures.py)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=16, num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1_000_000.0, rope_local_base_freq=500.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}
# Families whose checkpoints ship a SentencePiece tokenizer.model (llama.cpp's converter reads only that for
# them): given one trained here, in the family's style, instead of the reference model's BPE.
SENTENCEPIECE = {"gemma2": "gemma", "phi3": "llama2"}


def build(directory: Path, config_cls: str, model_cls: str, tokenizer_from: Path | None = TINY, **overrides) -> Path:
    """A random model saved in bf16 with save_pretrained, plus a tokenizer copied from ``tokenizer_from``."""
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    getattr(transformers, model_cls)(config).to(torch.bfloat16).save_pretrained(directory)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / f, directory / f)
    return directory


def check_against_transformers(model_dir: Path, res: api.ArtifactResult, texts: list[str], tok: object) -> None:
    files = res.manifest.quantization["files"]
    assert llama_tokenize(res.path / files["F16"], texts) == [tok(t)["input_ids"] for t in texts]
    ids = tok(texts[0])["input_ids"][:64]
    ref = hf_logits(model_dir, ids)
    f16 = llama_logits(res.path / files["F16"], ids)
    assert np.abs(ref - f16).max() < 0.02 * np.abs(ref).max(), "F16 logits differ from transformers"
    assert top1(ref, f16) >= 0.98
    if "Q4_K_M" in files:
        q4 = llama_logits(res.path / files["Q4_K_M"], ids)
        assert np.isfinite(q4).all()
        assert np.corrcoef(ref.ravel(), q4.ravel())[0, 1] > 0.95


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_converts_and_matches(family: str, tmp_path: Path, heldout: list[str]) -> None:
    config_cls, model_cls, overrides = FAMILIES[family]
    model_dir = tmp_path / f"tiny-{family}"
    if family in SENTENCEPIECE:
        tok = sentencepiece_tokenizer(model_dir, SENTENCEPIECE[family])
        build(model_dir, config_cls, model_cls, tokenizer_from=None, **{
            **overrides, "vocab_size": len(tok), "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    else:
        tok = transformers.AutoTokenizer.from_pretrained(TINY)
        build(model_dir, config_cls, model_cls, **overrides)
    res = convert(model_dir, tmp_path / "out", ["F16", "Q4_K_M"])
    q = res.manifest.quantization
    assert q["source_architecture"] == model_cls
    check_against_transformers(model_dir, res, heldout[:4], tok)
    # 64-wide rows cannot hold 256-value K-quant blocks: llama.cpp demotes Q4_K to Q5_0 (32-value blocks),
    # and every such tensor is named in the manifest with the type it really got
    fell = q["fallbacks"]["Q4_K_M"]
    types = tensor_types(res.path / q["files"]["Q4_K_M"])
    assert fell and all(types[name] == got for name, got in fell.items())
    assert "blk.0.attn_output.weight" in fell and not any(t in ("Q4_K", "Q6_K") for t in types.values())
    assert all(types[n] in ("F32", "Q5_0", "Q8_0", "F16") for n in types)


def test_q8_rows_that_are_not_whole_blocks_fall_back(tmp_path: Path) -> None:
    model_dir = build(tmp_path / "odd", "Qwen3Config", "Qwen3ForCausalLM", head_dim=32, intermediate_size=80)
    res = convert(model_dir, tmp_path / "out", ["Q8_0", "Q4_K_M"])
    fell = res.manifest.quantization["fallbacks"]
    # ffn_down rows are 80 values: not a whole 32-value Q8_0 block, so F16 (as llama.cpp's quantizer does)
    assert fell["Q8_0"] == {"blk.0.ffn_down.weight": "F16", "blk.1.ffn_down.weight": "F16"}
    assert fell["Q4_K_M"]["blk.0.ffn_down.weight"] == "F16" and fell["Q4_K_M"]["blk.0.ffn_up.weight"] == "Q5_0"
    assert tensor_types(res.path / "odd-Q8_0.gguf")["blk.0.ffn_up.weight"] == "Q8_0"
    assert any("fell back" in n for n in res.manifest.notes)


# ------------------------------------------------------------------------------------------------------------
# SentencePiece vocabularies


def llama2_style_tokenizer(directory: Path, texts: list[str]) -> None:
    """A Llama-2-style tokenizer.json (BPE with byte fallback over "▁"-joined text), trained with tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                                      special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    data = json.loads(tk.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_tokens]  # bytes are vocab
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                                bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)


def prose() -> list[str]:
    with gzip.open(ROOT / "calibration" / "prose.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()][:120]


def test_sentencepiece_style_tokenizer_json(tmp_path: Path, heldout: list[str]) -> None:
    model_dir = build(tmp_path / "tiny-llama2", "LlamaConfig", "LlamaForCausalLM", tokenizer_from=None,
                      vocab_size=1500, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama2_style_tokenizer(model_dir, prose())
    res = convert(model_dir, tmp_path / "out", ["F16"])
    assert res.manifest.quantization["tokenizer"] == "llama"
    assert res.manifest.quantization["pre_tokenizer"] in (None, "default")  # no BPE splitter: SentencePiece's
    # llama.cpp's converter scores such a vocabulary -1000 throughout; quantkit scores it by merge rank, and says so
    assert any("BPE merge ranks" in n for n in res.manifest.notes)
    texts = heldout[:12] + ["tabs\tand  double  spaces\n\n", "ünïcödé ✓ 你好"]
    check_against_transformers(model_dir, res, texts, transformers.AutoTokenizer.from_pretrained(model_dir))


def sentencepiece_tokenizer(model_dir: Path, style: str) -> object:
    """A SentencePiece BPE tokenizer.model (Llama 2 or Gemma style) trained on prose, written into ``model_dir``;
    returns transformers' tokenizer of it."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(prose()), model_writer=buf, vocab_size=1500, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, minloglevel=2,
        max_sentence_length=1 << 20, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=style == "llama2", split_digits=True)
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer.model").write_bytes(buf.getvalue())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer" if style == "llama2" else "GemmaTokenizer",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("style", ["llama2", "gemma"])
def test_sentencepiece_model(style: str, tmp_path: Path, heldout: list[str]) -> None:
    pytest.importorskip("google.protobuf")
    model_dir = tmp_path / f"tiny-{style}"
    tok = sentencepiece_tokenizer(model_dir, style)
    cls = ("LlamaConfig", "LlamaForCausalLM", {}) if style == "llama2" else \
        ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=32, query_pre_attn_scalar=32))
    build(model_dir, cls[0], cls[1], tokenizer_from=None, vocab_size=len(tok), bos_token_id=1, eos_token_id=2,
          pad_token_id=0, **cls[2])
    res = convert(model_dir, tmp_path / "out", ["F16"])
    assert res.manifest.quantization["tokenizer"] == "llama"
    reader = gguf.GGUFReader(res.path / res.manifest.quantization["files"]["F16"])
    prefix = reader.fields.get("tokenizer.ggml.add_space_prefix")  # llama.cpp's default when absent: true
    assert (bool(prefix.parts[prefix.data[0]][0]) if prefix else True) == (style == "llama2")
    # held-out documents only: for text that starts with a space, transformers' converted Llama tokenizer
    # differs from SentencePiece itself, which llama.cpp follows
    check_against_transformers(model_dir, res, heldout[:12], tok)


# ------------------------------------------------------------------------------------------------------------
# refusals, before any work


def test_unsupported_architecture_is_refused(tmp_path: Path, cli: Callable) -> None:
    """An architecture llama.cpp's converter has no class for (OPT): one line naming it, exit 2, nothing written."""
    model_dir = tmp_path / "opt"
    config = transformers.OPTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, ffn_dim=128,
                                    word_embed_proj_dim=64, vocab_size=8192)
    transformers.OPTForCausalLM(config).save_pretrained(model_dir)
    shutil.copy(TINY / "tokenizer.json", model_dir)  # a checkpoint's tokenizer is vetted with it
    proc = cli("gguf", model_dir, tmp_path / "out")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "llama.cpp's converter cannot convert OPTForCausalLM" in lines[0] and "not supported" in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_gemma3_layer_pattern_llamacpp_does_not_compute_is_refused(tmp_path: Path) -> None:
    """llama.cpp fixes Gemma 3's sliding/full pattern (every sixth layer full) and the converter writes none: a
    checkpoint with another pattern would convert into a file that attends differently (measured: architectures.py)."""
    config_cls, model_cls, overrides = FAMILIES["gemma3"]
    model_dir = build(tmp_path / "g3", config_cls, model_cls, **{
        **overrides, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(SourceModelError, match="not llama.cpp's fixed Gemma 3 pattern"):
        convert(model_dir, tmp_path / "out", ["F16"])
    assert not (tmp_path / "out").exists()


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(TINY, model_dir)
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    (model_dir / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(SourceModelError, match="no pre-tokenizer for"):
        convert(model_dir, tmp_path / "out", ["Q4_K_M"])
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_shipped_recipe() -> None:
    r = recipe.load(recipe.find("gguf"))
    assert r.quantize.method == "gguf" and r.quantize.types == ["Q8_0", "Q4_K_M"]
    assert r.model.source == "models/quantkit-tiny" and r.output == "out/gguf"


@pytest.mark.cli
def test_gguf_verb_help(cli: Callable) -> None:
    proc = cli("gguf", "--help", check=True)
    assert "--type" in proc.stdout and "--imatrix" in proc.stdout and "--imatrix-file" in proc.stdout



def test_conversion_bar_follows_the_converters_own_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """quantkit sets TQDM_DISABLE for the libraries it runs in-process; the converter's "Writing: N%" bar, which
    feeds quantkit's, must still be drawn, or the conversion shows 0% from start to end."""
    import io

    from rich.console import Console

    from quantkit.producers.gguf import convert
    from quantkit.progress import Reporter

    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = io.StringIO()
    convert.convert(TINY.resolve(), tmp_path / "t.gguf", "Q8_0", name="t",
                    reporter=Reporter(Console(file=out, width=200, force_terminal=False)))
    assert "100%" in out.getvalue(), out.getvalue()
