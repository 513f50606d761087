"""Vetting the source checkpoint: every bad input gets one clear message before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantkit import source
from quantkit.errors import SourceModelError
from quantkit.recipe import ModelSpec

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
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads everything; permission checks cannot be provoked")
    copy.chmod(0)
    try:
        with pytest.raises(SourceModelError, match="not readable"):
            source.vet(copy)
    finally:
        copy.chmod(0o755)


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


def test_the_pickle_hint_holds_for_gguf_which_has_no_allow_pickle(copy: Path) -> None:
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    with pytest.raises(SourceModelError) as e:
        source.vet(copy)
    assert "`quantkit gguf` reads nothing else" in (e.value.hint or "") and "to a verb that has it" in e.value.hint
