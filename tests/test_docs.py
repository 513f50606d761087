"""The README stays a one-screen entry that is true: its verb table is the CLI's verbs, and every page it and the
pages under docs/ link to exists (the reference lives in docs/, one page each, all reachable from the README)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

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
