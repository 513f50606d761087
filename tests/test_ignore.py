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
