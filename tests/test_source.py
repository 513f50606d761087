"""Vetting the source checkpoint: every bad input gets one clear message before any model loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantkit import source
from quantkit.errors import SourceModelError
from quantkit.recipe import ModelSpec

from permissions import without_dac

pytestmark = pytest.mark.unit


@pytest.fixture()
def copy(tmp_path: Path, tiny: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny, dst)
    return dst


def test_reference_model_vets(tiny: Path) -> None:
    s = source.resolve(ModelSpec(source=str(tiny)))
    assert s.architecture == "LlamaForCausalLM" and s.num_parameters == 10_490_112
    assert s.size_bytes == (tiny / "model.safetensors").stat().st_size


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SourceModelError, match="does not exist"):
        source.resolve(ModelSpec(source=str(tmp_path / "nope")))


def test_config_not_json(copy: Path) -> None:
    (copy / "config.json").write_text("{not json")
    with pytest.raises(SourceModelError, match="config.json is not valid JSON"):
        source.vet(copy)


def test_truncated_safetensors_detected_in_milliseconds(copy: Path) -> None:
    f = copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceModelError, match="truncated"):
        source.vet(copy)
    f.write_bytes(data[:5])
    with pytest.raises(SourceModelError, match="corrupt or truncated"):
        source.vet(copy)


def test_remote_code_refused_unless_trusted(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceModelError, match="--trust-remote-code"):
        source.vet(copy)
    assert source.vet(copy, trust_remote_code=True).architecture == "LlamaForCausalLM"


def test_pickle_refused_unless_allowed(copy: Path) -> None:
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    with pytest.raises(SourceModelError, match="--allow-pickle"):
        source.vet(copy)
    assert source.vet(copy, allow_pickle=True).is_pickle


def test_unreadable_folder(copy: Path) -> None:
    """A source folder its user may not read is refused by name before anything loads. Vetted in a process where
    permission bits hold (for root, its DAC capabilities dropped), since root reads everything."""
    vet = textwrap.dedent("""
        import sys
        from pathlib import Path
        from quantkit import source
        from quantkit.errors import SourceModelError
        try:
            source.vet(Path(sys.argv[1]))
        except SourceModelError as e:
            print(e)
            sys.exit(3)
        """)
    prefix = without_dac()
    copy.chmod(0)
    try:
        proc = subprocess.run([*prefix, sys.executable, "-c", vet, str(copy)], capture_output=True, text=True,
                              timeout=120)
    finally:
        copy.chmod(0o755)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "not readable" in proc.stdout and str(copy) in proc.stdout


@pytest.mark.cli
def test_hub_id_offline_is_one_clear_message(cli, tmp_path: Path) -> None:
    proc = cli("rtn", "someorg/somemodel", tmp_path / "out", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert "cannot download someorg/somemodel" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_weights_sha256_is_every_byte_hashed_once_per_version_of_a_file(copy: Path, tiny: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy elsewhere has the same weights digest (hashed again: new inode and times); a byte changed in the middle
    of a file changes it, even with the file's modification time put back, and an untouched file is not read again."""
    import os

    from quantkit import file_hashes

    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "cache"))
    first = source.vet(copy).weights_sha256()
    assert first == source.vet(tiny).weights_sha256()
    weights = copy / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert source.vet(copy).weights_sha256() != first

    read: list[Path] = []
    real = file_hashes.hash_many
    monkeypatch.setattr(file_hashes, "hash_many", lambda paths: (read.extend(paths), real(paths))[1])
    source.vet(copy).weights_sha256()
    assert read == []


def _set_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------------------------------------------
# Messages


def test_a_truncated_file_says_the_total_its_header_describes(copy: Path) -> None:
    """It said the end of the first tensor past the cut (4194304 bytes) instead of the header's total."""
    f = copy / "model.safetensors"
    _, data_len = source.safetensors_header(f)
    f.write_bytes(f.read_bytes()[: f.stat().st_size - data_len // 2])
    with pytest.raises(SourceModelError, match=rf"header describes 20,980,224 bytes of tensor data but the file holds "
                                                rf"{data_len - data_len // 2:,} after the header"):
        source.vet(copy)


def test_architectures_as_a_string_is_refused_saying_it(copy: Path) -> None:
    """A string was read one letter per class: 'is a L, l, a, m, a, ...'."""
    _set_config(copy, architectures="LlamaForCausalLM")
    with pytest.raises(SourceModelError, match="architectures is the string 'LlamaForCausalLM', not a list") as e:
        source.vet(copy)
    assert e.value.hint == 'write it as a list: "architectures": ["LlamaForCausalLM"]'
    _set_config(copy, architectures=[5])
    with pytest.raises(SourceModelError, match="expected a list of class names"):
        source.vet(copy)


@pytest.mark.cli
def test_a_model_type_transformers_does_not_know_is_one_error_line(cli, copy: Path, tmp_path: Path) -> None:
    """The tokenizer's read of config.json warned of "a model of type `foo`" before the model's load refused it."""
    _set_config(copy, model_type="foo", architectures=["FooForCausalLM"])
    proc = cli("rtn", copy, tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said[0].startswith("error: transformers cannot load") and "model type `foo`" in said[0], said
    assert len(said) == 2 and said[1].startswith("  hint:"), said


def test_the_pickle_hint_holds_for_gguf_which_has_no_allow_pickle(copy: Path) -> None:
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    with pytest.raises(SourceModelError) as e:
        source.vet(copy)
    assert "`quantkit gguf` reads nothing else" in (e.value.hint or "") and "to a verb that has it" in e.value.hint


# ----------------------------------------------------------------------------------------------------------------
# A sharded checkpoint


@pytest.fixture()
def sharded(tmp_path: Path, tiny: Path) -> Path:
    """The reference model in two shards and their index, as transformers writes them."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "sharded"
    shutil.copytree(tiny, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(str(tiny / "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: weights[k] for k in part}, str(dst / file), metadata={"format": "pt"})
        weight_map |= {k: file for k in part}
    (dst / source.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_a_sharded_checkpoint_vets(sharded: Path) -> None:
    s = source.vet(sharded)
    assert s.num_parameters == 10_490_112
    assert [f.name for f in s.weight_files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_a_shard_the_index_names_is_missing(sharded: Path) -> None:
    """--dry-run planned 7.3M parameters instead of 10.5M, and the run failed only when transformers loaded."""
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceModelError, match=r"lacks 1 of the 2 weight files its model.safetensors.index.json "
                                                r"names: model-00002-of-00002.safetensors \(\d+ tensors\)"):
        source.vet(sharded)


def test_a_tensor_of_the_index_not_in_its_shard_is_refused(sharded: Path) -> None:
    index = json.loads((sharded / source.INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (sharded / source.INDEX).write_text(json.dumps(index))
    with pytest.raises(SourceModelError, match=r"does not match its shards: 2 tensor\(s\) it names are not in the "
                                                r"shard it names them in: .*lm_head.weight"):
        source.vet(sharded)
    del index["weight_map"]["lm_head.weight"], index["weight_map"]["model.layers.9.mlp.up_proj.weight"]
    (sharded / source.INDEX).write_text(json.dumps(index))
    with pytest.raises(SourceModelError, match=r"1 tensor\(s\) of its shards it does not name: lm_head.weight"):
        source.vet(sharded)


def test_a_weight_file_the_index_does_not_name_is_refused(sharded: Path, tiny: Path) -> None:
    """transformers reads only the index's shards while the size, the weights' sha256 and the header checks counted
    every file; Mistral's own-format copy beside the shards is what loaders skip, and is left out."""
    shutil.copy(sharded / "model-00002-of-00002.safetensors", sharded / "model-00003-of-00003.safetensors")
    with pytest.raises(SourceModelError, match="weight files its model.safetensors.index.json does not name: "
                                               "model-00003-of-00003.safetensors"):
        source.vet(sharded)
    (sharded / "model-00003-of-00003.safetensors").rename(sharded / "consolidated.safetensors")
    s = source.vet(sharded)
    assert s.num_parameters == 10_490_112 and "consolidated.safetensors" not in {f.name for f in s.weight_files}


@pytest.mark.parametrize("text,words", [
    ('{"weight_map": {"a": "model-00001', "model.safetensors.index.json is not valid JSON"),
    ('{"metadata": {}}', "is not a safetensors index: it needs a weight_map"),
    ('{"weight_map": {"a": "../elsewhere/model.safetensors"}}', "names '../elsewhere/model.safetensors' as a shard"),
])
def test_an_unusable_index_is_refused(sharded: Path, text: str, words: str) -> None:
    (sharded / source.INDEX).write_text(text)
    with pytest.raises(SourceModelError, match=re.escape(words)):
        source.vet(sharded)


@pytest.mark.cli
def test_dry_run_refuses_a_broken_source_in_one_line(cli, sharded: Path, tmp_path: Path) -> None:
    """--dry-run, documented as checking everything, planned 7.3M parameters where a shard was missing."""
    (sharded / "model-00002-of-00002.safetensors").unlink()
    proc = cli("rtn", sharded, tmp_path / "out", "--dry-run")
    assert proc.returncode == 2 and "lacks 1 of the 2 weight files" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 2  # the error and its hint


# ----------------------------------------------------------------------------------------------------------------
# The decoder layers the config builds against those the weights hold


def test_weights_with_layers_the_config_leaves_out_are_refused_from_the_headers(copy: Path) -> None:
    """num_hidden_layers 4 over 8 layers of weights made a 4-layer artifact that passed verify (transformers drops
    the rest with a report on stderr only)."""
    _set_config(copy, num_hidden_layers=4)
    with pytest.raises(SourceModelError) as e:
        source.vet(copy)
    assert "decoder layers 4-7" in e.value.message and "num_hidden_layers (4)" in e.value.message
    assert "model.layers.4.input_layernorm.weight" in e.value.message
    assert "num_hidden_layers should be 8" in (e.value.hint or "")


def test_layers_the_weights_lack_are_refused_from_the_headers(copy: Path) -> None:
    _set_config(copy, num_hidden_layers=12)
    with pytest.raises(SourceModelError, match=r"num_hidden_layers is 12 but its weights hold no tensor of layers "
                                                r"8-11") as e:
        source.vet(copy)
    assert "should be 8" in (e.value.hint or "")


def test_no_decoder_layers_is_refused(copy: Path) -> None:
    """num_hidden_layers 0 failed after loading, naming a temporary folder of the output."""
    _set_config(copy, num_hidden_layers=0)
    with pytest.raises(SourceModelError, match="num_hidden_layers is 0, a model without decoder layers"):
        source.vet(copy)


def test_multi_token_prediction_layers_after_the_decoder_pass(copy: Path) -> None:
    """DeepSeek-V3 and GLM-4.5 ship num_nextn_predict_layers layers after the decoder's, unused by transformers."""
    _set_config(copy, num_hidden_layers=7, num_nextn_predict_layers=1)
    assert source.vet(copy).num_parameters == 10_490_112
    _set_config(copy, num_hidden_layers=6, num_nextn_predict_layers=1)
    with pytest.raises(SourceModelError, match=r"layer 7 that config.json's num_hidden_layers \(6\) and "
                                                r"num_nextn_predict_layers \(1\) leave out"):
        source.vet(copy)


def test_a_vision_language_models_text_layers_are_counted_not_its_towers(tmp_path: Path) -> None:
    """text_config's layer count against the language model's layers; the vision tower's 4 layers are its own."""
    from conftest import sparse_checkpoint

    tensors = {f"model.language_model.layers.{i}.input_layernorm.weight": [8] for i in range(2)}
    tensors |= {f"model.vision_tower.vision_model.encoder.layers.{i}.layer_norm1.weight": [8] for i in range(4)}
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": {"model_type": "llama", "num_hidden_layers": 2}, "vision_config": {"num_hidden_layers": 4}}
    folder = sparse_checkpoint(tmp_path / "vlm", config, tensors)
    assert source.vet(folder).num_parameters == 6 * 8
    config["text_config"]["num_hidden_layers"] = 1
    sparse_checkpoint(folder, config, tensors)
    with pytest.raises(SourceModelError, match=r"layer 1 that config.json's text_config.num_hidden_layers \(1\)"):
        source.vet(folder)


def test_tensors_the_built_model_does_not_use_are_refused() -> None:
    """The load's backstop (transformers' unexpected keys): a few named, and the config field likely at fault."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    source.check_unused("m", [], config)
    source.check_unused("m", ["model.layers.2.eh_proj.weight"], config)  # its MTP layer: unused by design
    with pytest.raises(SourceModelError, match=r"m: 1 tensor\(s\) .* not used .*: model.layers.3.mlp.up_proj") as e:
        source.check_unused("m", ["model.layers.3.mlp.up_proj.weight"], config)
    assert "num_hidden_layers" in (e.value.hint or "")
    keys = [f"model.layers.0.self_attn.q_norm.{i}" for i in range(8)]
    with pytest.raises(SourceModelError, match=r"8 tensor\(s\).*\(\+2 more\)") as e:
        source.check_unused("m", keys, config)
    assert "architectures and model_type" in (e.value.hint or "")
    vlm = {"model_type": "llava", "text_config": {"num_hidden_layers": 2}}
    with pytest.raises(SourceModelError) as e:
        source.check_unused("m", ["model.language_model.layers.5.mlp.up_proj.weight"], vlm)
    assert "text_config.num_hidden_layers" in (e.value.hint or "")


@pytest.mark.cli
def test_a_tensor_the_model_does_not_use_is_refused_when_it_loads(cli, copy: Path, tmp_path: Path) -> None:
    """A tensor whose name the headers cannot judge (another architecture's query norm under a Llama config) is
    refused from transformers' own load report, exit 2, before anything is quantized, in one line."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    proc = cli("rtn", copy, tmp_path / "out", "--quiet")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: " in proc.stderr and "not used by the model" in proc.stderr and "Traceback" not in proc.stderr
    assert "model.layers.0.self_attn.q_norm.weight" in proc.stderr
    assert "LOAD REPORT" not in proc.stderr  # transformers' table saying the same is not printed above the error
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer


def test_a_missing_tokenizer_is_refused(copy: Path) -> None:
    for f in copy.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(SourceModelError, match="has no tokenizer: none of tokenizer.json, tokenizer.model"):
        source.vet(copy)
    (copy / "vocab.json").write_text('{"a": 0}')  # a byte-level BPE vocabulary needs its merges
    with pytest.raises(SourceModelError, match="has no tokenizer"):
        source.vet(copy)
    (copy / "merges.txt").write_text("#version: 0.2\n")
    assert source.vet(copy).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("name,text,words", [
    ("tokenizer.json", '{"version":', "tokenizer.json is not valid JSON"),
    ("tokenizer.json", "[]", "tokenizer.json is not a tokenizer file"),
    ("tokenizer.json", '{"version": "1.0"}', 'tokenizer.json is not a tokenizers file: it has no "model"'),
    ("tokenizer_config.json", '{"model_max_length": 2', "tokenizer_config.json is not valid JSON"),
])
def test_a_truncated_tokenizer_file_is_refused(copy: Path, name: str, text: str, words: str) -> None:
    (copy / name).write_text(text)
    with pytest.raises(SourceModelError, match=words) as e:
        source.vet(copy)
    assert str(copy) in e.value.message


def test_a_tokenizer_that_does_not_load_is_one_error_naming_folder_and_file(copy: Path) -> None:
    """What parses but does not load (a BPE model without its vocabulary) fails in transformers: one line."""
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["model"] = {"type": "BPE"}
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    source.vet(copy)
    with pytest.raises(SourceModelError, match=rf"cannot load the tokenizer of {copy} \(tokenizer.json\): "):
        source.load_tokenizer(copy)


@pytest.mark.cli
@pytest.mark.parametrize("verb", ["rtn", "gguf"])
def test_a_tokenizer_that_does_not_load_is_exit_2_in_every_verb(cli, copy: Path, tmp_path: Path, verb: str) -> None:
    """The llm-compressor verbs load it with transformers, gguf through llama.cpp's converter: each says the
    tokenizer file, not the converter, is what failed (gguf said the converter could not convert Llama)."""
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["model"] = {"type": "BPE"}
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    proc = cli(verb, copy, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"the tokenizer of {copy} (tokenizer.json)" in proc.stderr and "Missing vocab/merges" in proc.stderr
    assert "Traceback" not in proc.stderr and "convert_hf_to_gguf.py --print-supported-models" not in proc.stderr


def test_a_revision_on_a_local_folder_is_refused(tiny: Path) -> None:
    """``--revision`` pins a hub download; on a local folder nothing could honour it, and the manifest recorded it
    as the source's revision all the same."""
    with pytest.raises(SourceModelError, match="names a hub revision, but .* is a local folder"):
        source.resolve(ModelSpec(source=str(tiny), revision="v9"))
    assert source.resolve(ModelSpec(source=str(tiny))).revision is None


@pytest.mark.parametrize("text", ['{"eos_token_id": [1, 3]', "[1, 3]"])
def test_an_unreadable_generation_config_is_refused_not_replaced(copy: Path, text: str) -> None:
    """transformers silently rebuilds a generation config it cannot read from config.json, and the artifact would
    ship the rebuilt one (another EOS list): refused, naming the file."""
    (copy / "generation_config.json").write_text(text)
    with pytest.raises(SourceModelError, match="generation_config.json"):
        source.vet(copy)
