"""The README stays a one-screen entry that is true: its verb table is the CLI's verbs, and every page it and the
pages under docs/ link to exists (the reference lives in docs/, one page each, all reachable from the README)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from quantkit import formats, recipe
from quantkit.cli.main import app

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _verbs(group: Any, prefix: str = "") -> set[str]:
    """Every command the CLI offers, a group's as ``group sub`` (``calib list``); ``group`` is a click group (typer
    vendors its own click, so it is recognised by its ``commands``)."""
    out: set[str] = set()
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            out |= _verbs(command, f"{prefix}{name} ")
        elif not command.hidden:
            out.add(prefix + name)
    return out


def _readme_verbs() -> set[str]:
    text = README.read_text()
    table = text.split("## Verbs", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


def test_the_readme_lists_every_verb_and_only_verbs() -> None:
    assert _readme_verbs() == _verbs(typer.main.get_command(app))


def test_every_link_of_the_readme_and_the_docs_exists() -> None:
    for page in [README, *PAGES]:
        for target in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t).resolve() for t in LINK.findall(README.read_text()) if "://" not in t}
    assert PAGES and not [p.name for p in PAGES if p.resolve() not in linked]


def _help(command: list[str]) -> str:
    """``quantkit COMMAND --help`` as a user reads it (the process' own help, not the docstring)."""
    shown = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    return shown.output


def _named_without_examples(page: Path) -> set[str]:
    """The verbs a page says show no examples in their help: "with examples for every verb but `a` and `b`", none
    where it says "with examples for every verb" alone."""
    text = " ".join(page.read_text().split())
    said = re.search(r"with examples for every verb( but ((?:`[^`]+`(?:,| and|) ?)+))?", text)
    assert said, f"{page.relative_to(ROOT)} no longer says which verbs show examples"
    return set(re.findall(r"`([^`]+)`", said.group(2) or ""))


def test_every_verb_shows_examples_but_the_ones_readme_and_usage_name() -> None:
    """README and docs/usage.md said every verb's --help has examples while nine of them had none: the verbs
    without an Examples section are exactly those the pages name."""
    without = {verb for verb in _verbs(typer.main.get_command(app)) if "Examples" not in _help(verb.split())}
    assert _named_without_examples(README) == without
    assert _named_without_examples(ROOT / "docs" / "usage.md") == without


def test_the_recipe_example_lists_every_method() -> None:
    """docs/recipes.md's ``method:`` comment is the schema's list of methods (it had left out nvfp4 and mxfp4)."""
    line = next(x for x in (ROOT / "docs" / "recipes.md").read_text().splitlines() if "- method: awq " in x)
    listed = [m.strip() for m in line.split("#", 1)[1].split(",", 1)[0].split("|")]
    assert listed == list(formats.methods())


def test_a_shown_recipe_has_every_field() -> None:
    """``quantkit recipes NAME`` shows every field with its default filled in, as README and recipes.md say: a
    field whose default is null (group_size, target_bits, model.revision) was left out, so a user never saw it."""
    shown = CliRunner().invoke(app, ["recipes", "awq"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    body = shown.output.split("\n", 1)[1]
    assert yaml.safe_load(body) == recipe.load(ROOT / "recipes" / "awq.yaml").model_dump(mode="json")
    assert "  group_size: null" in body and "  revision: null" in body
