"""``inspect`` and ``verify``: what an artifact is, and whether its files still match their manifest."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from quantkit import api
from quantkit.cli.common import JSON_OPT, command, console, emit_json
from quantkit.errors import IntegrityError


@command
def inspect_cmd(
    path: Path = typer.Argument(..., help="Artifact folder, checkpoint folder or .gguf file."),
    json: bool = JSON_OPT,
) -> None:
    """Print what an artifact is: format, bits, scheme, size, compression vs the source, and the manifest check
    (every file's sha256 re-verified). Exits 1 if any file differs from the manifest."""
    info = api.inspect(path)
    man = info.get("manifest")
    if json:
        emit_json(info)
    else:
        c = console(False)
        t = Table(show_header=False, title=str(path), title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        keys = ["format", "method", "ct_format", "scheme", "bits", "group_size", "symmetric", "strategy",
                "activations", "kv_cache", "ignore", "compressed_tensors_version", "source", "created",
                "quantkit_version"]
        for k in keys:
            if info.get(k) is not None:
                t.add_row(k, str(info[k]))
        t.add_row("size", api.fmt_bytes(info["size_bytes"]))
        if info.get("compression"):
            t.add_row("compression", f"{info['compression']}x vs source ({api.fmt_bytes(info['source_size_bytes'])})")
        if info.get("bits_per_weight"):
            t.add_row("bits per weight", str(info["bits_per_weight"]))
        for g in info.get("gguf", []):
            extra = f", {g['bits_per_weight']} bpw" if "bits_per_weight" in g else ""
            t.add_row(g["file"], f"{g.get('type', g.get('error', '?'))}, {api.fmt_bytes(g['size'])}{extra}")
        if info.get("calibration"):
            cal = info["calibration"]
            t.add_row("calibration", f"{cal['dataset']}: {cal['samples']} x {cal['seq_len']} tokens, "
                                     f"sha256 {cal['tokens_sha256'][:16]}…")
        ev = info.get("evaluation")
        if ev:
            t.add_row("evaluation", ", ".join(f"{k}={v}" for k, v in (ev.get("summary") or {}).items()))
        if man is None:
            t.add_row("manifest", "[yellow]none (not written by quantkit)[/]")
        elif man["ok"]:
            t.add_row("manifest", f"[green]ok[/]: {man['checked']} files, every sha256 verified")
        else:
            t.add_row("manifest", f"[red]MISMATCH[/]: changed {man['changed']}, missing {man['missing']}, "
                                  f"not in manifest {man['extra']}")
        c.print(t)
    if man is not None and not man["ok"]:
        raise IntegrityError(f"{path}: files differ from the manifest (changed: {man['changed']}, "
                             f"missing: {man['missing']}, not in manifest: {man['extra']})")


@command
def verify_cmd(
    path: Path = typer.Argument(..., help="Artifact folder, a file inside one, or a release folder of artifacts."),
    json: bool = JSON_OPT,
) -> None:
    """Re-hash every file against quantkit.json and report any difference (tampering, bit rot, incomplete copy).
    Exits 1 on any mismatch. A file is checked against the manifest of its folder; a release folder artifact by
    artifact, then every file of it against its SHA256SUMS (a release without one is not sealed: its last run
    did not finish)."""
    results = api.verify_all(path)
    if json:
        emit_json([r.to_json() for r in results])
    else:
        c = console(False)
        for r in results:
            where = escape(str(r.root))
            if not r.sealed:
                c.print(f"[red]NOT SEALED[/] {where}: no {r.seal} (quantkit run writes it last: its last run on "
                        "this folder did not finish)")
            elif r.ok:
                c.print(f"[green]ok[/] {where}: {r.checked} {'file matches' if r.checked == 1 else 'files match'} "
                        f"{r.seal}")
            else:
                c.print(f"[red]MISMATCH[/] {where} against {r.seal}: "
                        + escape(f"changed {r.changed}, missing {r.missing}, not listed {r.extra}"))
    bad = [r for r in results if not r.ok]
    if bad:
        raise IntegrityError(f"{len(bad)} of {len(results)} checked differ from their seal: "
                             + ", ".join(f"{r.root} ({r.seal}{'' if r.sealed else ' missing'})" for r in bad))


def register(app: typer.Typer) -> None:
    app.command("inspect", rich_help_panel="Artifacts")(inspect_cmd)
    app.command("verify", rich_help_panel="Artifacts")(verify_cmd)
