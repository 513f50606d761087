"""The test tiers (tests/conftest.py, docs/testing.md): a module's mark is its tests' tier, a test's own tier mark
(or ``slow``) replaces it, ``-m`` selects on that one tier, and a test without a tier stops the run before any test.

Each case is a real pytest process on a small test folder using this suite's own conftest.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent

MIXED = '''import pytest

pytestmark = pytest.mark.unit


def test_plain():
    pass


@pytest.mark.cli
def test_process():
    pass


@pytest.mark.slow
def test_heavy():
    pass


@pytest.mark.gpu
def test_cuda():
    pass
'''


def collect(tmp_path: Path, modules: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``pytest --collect-only -q ARGS`` over ``modules`` (name -> source) beside a copy of this suite's conftest,
    with the tier markers pyproject.toml declares."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  unit\n  cli\n  e2e\n  gpu\n  slow\n")
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--strict-markers", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def selected(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line)


@pytest.mark.parametrize(("expr", "tests"), [
    ("unit or cli", ["test_plain", "test_process"]),  # neither the slow test nor the gpu one of a unit module
    ("e2e or gpu", ["test_cuda", "test_heavy"]),
])
def test_the_nearest_tier_mark_is_the_only_one(tmp_path: Path, expr: str, tests: list[str]) -> None:
    proc = collect(tmp_path, {"test_mixed.py": MIXED}, "-m", expr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert selected(proc) == tests


def test_a_test_without_a_tier_stops_the_run(tmp_path: Path) -> None:
    proc = collect(tmp_path, {"test_mixed.py": MIXED, "test_new.py": "def test_forgotten():\n    pass\n"})
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "1 test(s) have no tier mark" in proc.stderr and "test_new.py::test_forgotten" in proc.stderr


def test_two_tiers_on_one_test_stop_the_run(tmp_path: Path) -> None:
    both = "import pytest\n\n\n@pytest.mark.unit\n@pytest.mark.e2e\ndef test_both():\n    pass\n"
    proc = collect(tmp_path, {"test_both.py": both})
    assert proc.returncode == 4 and "marked with tiers ['e2e', 'unit']" in proc.stderr, proc.stdout + proc.stderr
