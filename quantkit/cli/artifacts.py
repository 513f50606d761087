"""``inspect`` and ``verify``: what an artifact is, and whether its files still match their manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from quantkit import api
from quantkit.cli.common import JSON_OPT, command, console, emit_json
from quantkit.errors import IntegrityError


@command
def inspect_cmd(
    path: Path = typer.Argument(..., help="Artifact folder, checkpoint folder, .gguf file or release folder."),
    json: bool = JSON_OPT,
) -> None:
    """Print what an artifact is: format, bits, scheme, size, compression vs the source, and the manifest check
    (every file's sha256 re-verified; a .gguf file against the manifest of its folder). A release folder: each of
    its artifacts, then the release against its SHA256SUMS. Exits 1 if any file differs from its seal, or if a .gguf
    file is not one.

    [bold]Examples[/]

      [bold]$[/] quantkit inspect out/awq

      [bold]$[/] quantkit inspect out/gguf/quantkit-tiny-Q4_K_M.gguf --json"""
    info = api.inspect(path)
    parts = info.get("artifacts", [info])
    seals = [p["manifest"] for p in parts if p["manifest"] is not None] + [info[k] for k in ("release",) if k in info]
    if json:
        emit_json(info)
    else:
        c = console(False)
        for part in parts:
            c.print(_artifact_table(part))
        if "release" in info:
            status, detail = _seal(info["release"])
            c.print(f"{status} release {escape(str(path))}: {detail}")
    bad = [s for s in seals if not s["ok"]]
    if bad:
        raise IntegrityError(f"{path}: files differ from their seal: " + "; ".join(f"{s['path']} {_found(s)}"
                                                                                   for s in bad))


def _artifact_table(info: dict[str, Any]) -> Table:
    t = Table(show_header=False, title=escape(info["path"]), title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    keys = ["format", "method", "ct_format", "scheme", "bits", "group_size", "symmetric", "strategy",
            "activations", "kv_cache", "ignore", "compressed_tensors_version", "source", "created",
            "quantkit_version"]
    for k in keys:
        if info.get(k) is not None:
            t.add_row(k, escape(str(info[k])))
    groups = info.get("groups") or []
    for g in groups if len(groups) > 1 else []:  # one group is the rows above
        t.add_row(escape(str(g["scheme"])), escape(_group(g)))
    t.add_row("size", _size(info))
    if info.get("compression"):
        t.add_row("compression", f"{info['compression']}x vs source ({api.fmt_bytes(info['source_size_bytes'])})")
    if info.get("bits_per_weight"):
        t.add_row("bits per weight (quantized layers)", str(info["bits_per_weight"]))
    if info.get("bits_per_parameter"):
        t.add_row("bits per parameter (whole model)", str(info["bits_per_parameter"]))
    for g in info.get("gguf", []):
        extra = f", {g['bits_per_weight']} bpw" if "bits_per_weight" in g else ""
        t.add_row(escape(g["file"]), escape(f"{g.get('type', g.get('error', '?'))}, {api.fmt_bytes(g['size'])}{extra}"))
    if info.get("calibration"):
        cal = info["calibration"]
        t.add_row("calibration", f"{escape(cal['dataset'])}: {cal['samples']} x {cal['seq_len']} tokens, "
                                 f"sha256 {cal['tokens_sha256'][:16]}…")
        t.add_row("calibration documents", _documents(cal))
    ev = info.get("evaluation")
    if ev:
        t.add_row("evaluation", escape(", ".join(f"{k}={v}" for k, v in (ev.get("summary") or {}).items())))
    if info["manifest"] is None:
        t.add_row("manifest", "[yellow]none (not written by quantkit)[/]")
    else:
        status, detail = _seal(info["manifest"])
        t.add_row("manifest", f"{status}: {detail}")
    return t


def _documents(cal: dict[str, Any]) -> str:
    """The documents the calibration samples were made from and how many repeat an earlier one, as the manifest
    records them (``--json`` gave them, the table did not): ``15 (3 repeat an earlier one)``. A manifest of an older
    quantkit did not count them (null): "unknown", never 0, which would say that none repeats."""
    documents, repeated = cal.get("documents"), cal.get("repeated_documents")
    if documents is None and repeated is None:
        return "unknown (not counted by the quantkit that made this artifact)"
    counts = ["unknown" if n is None else f"{n:,}" for n in (documents, repeated)]
    return f"{counts[0]} ({counts[1]} repeat an earlier one)"


def _group(g: dict[str, Any]) -> str:
    """One config group of a mix, as a row: ``int4 group 32 asymmetric, 40 layers, 4,915,200 weights (78%)``."""
    grain = f"group {g['group_size']}" if g.get("group_size") else f"per {g['strategy']}" if g.get("strategy") else ""
    symmetry = {True: "symmetric", False: "asymmetric"}.get(g.get("symmetric"), "")
    what = " ".join(w for w in (f"{g.get('type')}{g.get('bits')}", grain, symmetry) if w)
    if g.get("weights") is None:  # the files' headers gave no quantized layer: the config alone
        return what
    share = f" ({g['share']:.0%})" if g.get("share") is not None else ""
    return f"{what}, {g['layers']} layers, {g['weights']:,} weights{share}"


def _size(info: dict[str, Any]) -> str:
    """The artifact's size, and apart from it the legacy layout's copy of the same weights (not in the size)."""
    size = api.fmt_bytes(info["size_bytes"])
    copy = info.get("legacy_copy")
    if copy:
        size += f" + {api.fmt_bytes(copy['size_bytes'])} legacy {escape(Path(copy['path']).name)}/ copy"
    return size


def _seal(check: dict[str, Any]) -> tuple[str, str]:
    """A verification (:meth:`quantkit.integrity.VerifyResult.to_json`) as a coloured status and what it found."""
    status = "[green]ok[/]" if check["ok"] else "[red]MISMATCH[/]" if check["sealed"] else "[red]NOT SEALED[/]"
    return status, escape(_found(check))


def _found(check: dict[str, Any]) -> str:
    if not check["sealed"]:
        return f"no {check['seal']} (quantkit run writes it last: its last run on this folder did not finish)"
    if check["ok"]:
        n = check["checked"]
        return f"{n} {'file matches' if n == 1 else 'files match'} {check['seal']}"
    return (f"against {check['seal']}: changed {check['changed']}, missing {check['missing']}, "
            f"not listed {check['extra']}")


@command
def verify_cmd(
    path: Path = typer.Argument(..., help="Artifact folder, a file inside one, or a release folder of artifacts."),
    json: bool = JSON_OPT,
) -> None:
    """Re-hash every file against quantkit.json and report any difference (tampering, bit rot, incomplete copy).
    Exits 1 on any mismatch. A file, or a folder inside an artifact (the gptq/ or autoawq/ copy of --format gptq or
    autoawq), is checked against the manifest of its artifact; a release folder artifact by artifact, then every
    file of it against its SHA256SUMS (a release without one is not sealed: its last run
    did not finish).

    [bold]Examples[/]

      [bold]$[/] quantkit verify out/awq

      [bold]$[/] quantkit verify out/gguf/quantkit-tiny-Q8_0.gguf    [dim]# one file, against its folder's manifest[/]

      [bold]$[/] quantkit verify out/demo    [dim]# a release: each artifact, then SHA256SUMS[/]"""
    results = [r.to_json() for r in api.verify_all(path)]
    if json:
        emit_json(results)
    else:
        c = console(False)
        for r in results:
            status, detail = _seal(r)
            c.print(f"{status} {escape(r['path'])}: {detail}")
    bad = [r for r in results if not r["ok"]]
    if bad:
        raise IntegrityError(f"{len(bad)} of {len(results)} checked differ from their seal: "
                             + "; ".join(f"{r['path']} {_found(r)}" for r in bad))


def register(app: typer.Typer) -> None:
    app.command("inspect", rich_help_panel="Artifacts")(inspect_cmd)
    app.command("verify", rich_help_panel="Artifacts")(verify_cmd)
