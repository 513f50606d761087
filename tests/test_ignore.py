"""--ignore patterns (quantkit.ignore): each is checked against the checkpoint's modules before anything loads, and a
``re:`` pattern that is no regular expression is one line naming it (exit 2), never re.error's traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit import ignore, source as source_mod
from quantkit.errors import UsageError
from quantkit.formats.specs import RtnSpec
from quantkit.recipe import ModelSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("pattern, error", [("re:[", "unterminated character set"),
                                            ("re:model.(layers", "missing ), unterminated subpattern")])
def test_a_pattern_that_is_no_regex_is_named_with_its_error(tiny: Path, pattern: str, error: str) -> None:
    src = source_mod.resolve(ModelSpec(source=str(tiny)))
    with pytest.raises(UsageError) as e:
        ignore.effective(RtnSpec(method="rtn", ignore=[pattern]), src)
    assert e.value.message.startswith(f"--ignore {pattern!r} is not a valid regular expression: {error}")


def test_a_valid_regex_still_keeps_its_modules(tiny: Path) -> None:
    src = source_mod.resolve(ModelSpec(source=str(tiny)))
    kept = ignore.effective(RtnSpec(method="rtn", ignore=[r"re:model\.layers\.0\.mlp\..*"]), src)
    assert kept[-1] == r"re:model\.layers\.0\.mlp\..*"


@pytest.mark.cli
def test_a_malformed_regex_through_the_cli(cli, tiny: Path, tmp_path: Path) -> None:
    for flags in ([], ["--dry-run"]):
        proc = cli("rtn", tiny, tmp_path / "out", "--ignore", "re:[", *flags)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith("error: --ignore 're:[' is not a valid regular expression")
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.cli
@pytest.mark.parametrize("verb, pattern", [("fp8", "re:.*"), ("nvfp4", "re:.*proj")])
def test_an_ignore_list_that_leaves_nothing_to_quantize_is_refused_before_loading(cli, tiny: Path, tmp_path: Path,
                                                                                 verb: str, pattern: str) -> None:
    """llm-compressor would load, run and save, then write no quantization config; refused from the headers instead,
    by the run and by --dry-run alike (docs/formats.md promises it)."""
    flags = ["--scheme", "dynamic"] if verb == "fp8" else ["--algorithm", "rtn"]
    for dry in ([], ["--dry-run"]):
        proc = cli(verb, tiny, tmp_path / "out", "--ignore", pattern, *flags, *dry)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith(f"error: the ignore list (lm_head, {pattern}) keeps every layer of ")
        assert "nothing would be quantized" in proc.stderr and "Traceback" not in proc.stderr
        assert "Loading" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.cli
@pytest.mark.parametrize("verb, flags, pattern", [("rtn", [], "model.layers.0.self_attn.k_proj"),
                                                  ("fp8", ["--scheme", "dynamic"], "re:.*up_proj$")])
def test_part_of_a_layer_vllm_fuses_is_refused_before_loading(cli, tiny: Path, tmp_path: Path, verb: str,
                                                              flags: list[str], pattern: str) -> None:
    """vLLM fuses q/k/v and gate/up into one layer and refuses a compressed-tensors checkpoint whose parts differ
    ("vLLM requires all to use the same scheme"): an artifact that only fails where it is served. Refused from the
    headers by every compressed-tensors method, naming the siblings; the whole group ignored is fine."""
    for dry in ([], ["--dry-run"]):
        proc = cli(verb, tiny, tmp_path / "out", "--ignore", pattern, *flags, *dry)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "vLLM fuses" in proc.stderr and "so they are quantized or kept together" in proc.stderr
        assert "--ignore model.layers.0." in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "out").exists()
    whole = "re:.*self_attn.[qkv]_proj$" if "k_proj" in pattern else "re:.*mlp.(gate|up)_proj$"
    assert cli(verb, tiny, tmp_path / "out", "--ignore", whole, *flags, "--dry-run").returncode == 0
