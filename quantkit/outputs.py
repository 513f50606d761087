"""Where quantkit may write, decided before any work: it never destroys what the user has.

Two rules, one module, used by every verb that writes (the producers, ``run`` and its bundle, ``eval``'s report):

* **Outputs stay apart from inputs.** An output folder is never the source checkpoint, never holds it and never
  lies inside it (``--force`` replaces the whole folder; writing into a checkpoint changes what the user has); an
  input file (a calibration or evaluation text, an importance matrix, the recipe itself) never lies inside a
  folder that gets replaced nor at a file quantkit writes. Paths are compared resolved, through symlinks and
  ``..``, so ``models/m/../m`` and a link to the source are the source.
* **Only quantkit's files are replaced.** ``--force`` replaces a folder holding a quantkit manifest, or an empty
  folder (:func:`quantkit.artifact.check_replaceable`); a report, a ``SHA256SUMS`` or a plot is rewritten only
  when the file at that name is one quantkit wrote (:func:`check_file`). Anything else is refused: the user
  removes it, or chooses another output. An artifact holding files its manifest does not list (the user's notes,
  data) is the user's too, in part: refused, naming them. A report breaks no seal it is not sealed anew in:
  never into another artifact or a release, nor a folder inside one (:func:`check_outside_seals`).

Every refusal is exit 2: an :class:`~quantkit.errors.UnsafeOutputError` naming both paths, an
:class:`~quantkit.errors.OutputExistsError`, or a :class:`~quantkit.errors.UsageError` for an output that cannot
be created at all (:func:`check_writable`: a file on its path, a folder that takes no new files).
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from quantkit import artifact
from quantkit.errors import DiskSpaceError, OutputExistsError, UnsafeOutputError, UsageError, too_long
from quantkit.integrity import BUNDLE_FILES, LOGS, SUMS, holds_manifest, wrote
from quantkit.locks import LOCK
from quantkit.manifest import MANIFEST, TEMPORARY

REMOVE_HINT = "remove it yourself, or choose another output"
# Every name quantkit gives a meaning in a release folder: the bundle's files, its logs, and the manifest that would
# make the folder read as one artifact. No output's folder may take one (quantkit.recipe refuses it).
RELEASE_NAMES = (*BUNDLE_FILES, LOGS, MANIFEST)
# The empty folder check_writable creates and removes at once to ask a folder whether it takes new entries.
PROBE_PREFIX = ".quantkit-probe-"
PROBE = re.compile(re.escape(PROBE_PREFIX) + ".+")
# The hidden entries a run of quantkit leaves beside an output: its lock (locks.LOCK), the folder it builds or
# moves aside while replacing it (artifact.LEFTOVER), a file written atomically (manifest.TEMPORARY) and the probe
# folder (PROBE), the last four only where a run was killed. Anything else hidden in a release folder is the user's.
LEFT_BY_A_RUN = re.compile(rf"{LOCK.pattern}|{artifact.LEFTOVER.pattern}|{TEMPORARY.pattern}|{PROBE.pattern}")


def real(path: str | Path) -> Path:
    """A path as the file system sees it: ``~`` expanded, made absolute, symlinks and ``..`` resolved (also for
    the part that does not exist yet)."""
    return Path(os.path.expanduser(str(path))).resolve()


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_apart(output: Path, source: Path | None = None, inputs: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse an output folder that is, holds or lies inside ``source``, or that holds one of ``inputs``
    ((description, path) pairs)."""
    out = real(output)
    if source is not None:
        src = real(source)
        if out == src:
            raise UnsafeOutputError(f"output {output} is the source model {source}: quantkit never writes over its "
                                    "source", hint="choose another output folder")
        if _within(src, out):
            raise UnsafeOutputError(f"output {output} holds the source model {source}: --force would remove it",
                                    hint="choose an output folder that does not hold the source")
        if _within(out, src):
            raise UnsafeOutputError(f"output {output} lies inside the source model {source}: quantkit never "
                                    "writes into its source", hint="choose an output folder outside the source")
    for name, path in inputs:
        if _within(real(path), out):
            raise UnsafeOutputError(f"output {output} holds the {name} {path}: replacing the output would remove it",
                                    hint=f"move the {name} out of {output}, or choose another output folder")


def check_files(folder: Path, names: Iterable[str], source: Path | None = None,
                inputs: Iterable[tuple[str, Path]] = (), what: str = "report folder") -> None:
    """Before writing files ``names`` into ``folder``: not into the source (nor below it), not over an input,
    and not over a file quantkit did not write."""
    out = real(folder)
    if source is not None and _within(out, real(source)):
        raise UnsafeOutputError(f"{what} {folder} lies inside the source model {source}: quantkit never writes "
                                "into its source", hint="choose another folder")
    targets = {real(folder / n): folder / n for n in names}
    for name, path in inputs:
        if real(path) in targets:
            raise UnsafeOutputError(f"{what} {folder} would overwrite the {name} {path}",
                                    hint=f"move the {name}, or choose another folder")
    for target in targets.values():
        check_file(target)
    check_writable(folder, what, into=True)


def check_outside_seals(folder: Path, names: Iterable[str], evaluated: Iterable[Path],
                        what: str = "report folder") -> None:
    """Before writing files ``names`` into ``folder`` (an evaluation's report): refuse a folder whose seal they would
    break, which ``verify`` would then report as changed or not listed: an artifact (a folder holding its
    manifest) or a folder inside one, a release (a folder holding :data:`~quantkit.integrity.SUMS`) or a folder
    inside one. Two such folders take them, as they seal them anew: an evaluated artifact itself (``evaluated``:
    each evaluated artifact's folder, or the evaluated path where it has none), whose manifest the evaluation
    updates; a release holding every evaluated path, whose bundle ``quantkit run`` writes and seals again. A folder
    is an artifact here as everywhere (:func:`quantkit.integrity.holds_manifest`): its ``quantkit.json`` a FIFO or a
    device too, which verify and smoke take for the artifact it claims to be, and any ``quantkit.json`` above,
    even one verify would pass over as no seal of an artifact below it (:func:`quantkit.integrity.artifact_of`):
    a report refused costs another ``--report-dir``, a report written into a seal breaks it."""
    out = real(folder)
    mine = [real(p) for p in evaluated]
    files = ", ".join(names)
    hint = "choose another --report-dir: an evaluated artifact, or a folder outside other artifacts and releases"
    for home in (out, *out.parents):
        if holds_manifest(home):
            if home == out and out in mine:
                return
            where = "is another quantkit artifact" if home == out else f"lies inside the quantkit artifact {home}"
            raise UnsafeOutputError(f"{what} {folder} {where}: writing {files} there would break its seal "
                                    f"({MANIFEST})", hint=hint)
        if (home / SUMS).is_file():
            if home == out and all(_within(p, out) for p in mine):
                return
            where = ("is a release that does not hold every evaluated artifact" if home == out
                     else f"lies inside the release {home}")
            raise UnsafeOutputError(f"{what} {folder} {where}: writing {files} there would break its seal ({SUMS})",
                                    hint=hint)


def check_file(path: Path) -> None:
    """Refuse to overwrite a file at ``path`` that quantkit did not write (a missing one is fine)."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_file() or not wrote(path):
        raise OutputExistsError(f"{path} exists and was not written by quantkit", hint=REMOVE_HINT)


def check_writable(output: Path, what: str = "output", *, into: bool = False) -> None:
    """Refuse an output quantkit could not create, before any work (``--dry-run`` too): a file where a folder on
    its path should be, or a folder that takes no new entries (read-only, ``/proc``, ``/sys``, no permission).
    The writer creates its lock and temporary folder beside the output (``into``: files go into ``output``
    itself, a report folder), so the first folder on the way that exists is asked, by creating and removing an
    empty hidden folder there: permission bits do not tell, and root passes every ``access`` check."""
    output = Path(os.path.expanduser(str(output)))
    if (error := too_long(str(output))) is not None:
        raise error
    probe = output if into else output.parent
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{what} {output} cannot be created: {probe} is not a folder",
                         hint="choose an output in a folder you can write")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=probe))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskSpaceError(f"{what} {output} cannot be written: {probe} has no space left",
                                 hint="free some space or write the output elsewhere") from None
        raise UsageError(f"{what} {output} cannot be created: nothing can be written in {probe} ({e.strerror})",
                         hint="choose an output in a folder you can write") from None


def recipe_inputs(recipe: Any) -> list[tuple[str, Path]]:
    """The files a recipe reads besides the source: the recipe file, calibration and evaluation texts given as
    paths, importance matrices."""
    found: list[tuple[str, Path]] = []
    if getattr(recipe, "path", None) is not None:
        found.append(("recipe", Path(recipe.path)))
    for name, value in (("calibration file", recipe.calibration.dataset), ("evaluation file", recipe.evaluation.dataset)):
        p = Path(os.path.expanduser(value))
        if p.exists():
            found.append((name, p))
    for spec, _ in recipe.artifacts():
        given = getattr(spec, "imatrix_file", None)
        if given:
            found.append(("importance matrix", Path(given)))
    return found


def local_source(recipe: Any) -> Path | None:
    """The source checkpoint's folder when it is on this machine under the name given (a hub id is not)."""
    p = Path(os.path.expanduser(recipe.model.source))
    return p if p.exists() else None


def check_recipe(recipe: Any, *, force: bool = False, pipeline: bool = False, source: Path | None = None) -> None:
    """Every output of a recipe apart from its source and inputs, and replaceable where ``--force`` would replace
    it; with ``pipeline`` also the release folder and its bundle files (``quantkit run``)."""
    src = source if source is not None else local_source(recipe)
    inputs = recipe_inputs(recipe)
    for _, out in recipe.artifacts():
        check_apart(out, src, inputs)
        check_writable(out)
        if force and (out.exists() or out.is_symlink()):
            artifact.check_replaceable(out)
    if pipeline and recipe.outputs is not None:  # one output's bundle lives in the artifact, replaced with it
        check_files(Path(recipe.output), BUNDLE_FILES, src, inputs, what="release folder")
        check_release_holds_only_its_own(Path(recipe.output), {out.name for _, out in recipe.artifacts()})


def check_release_holds_only_its_own(release: Path, outputs: set[str]) -> None:
    """A release folder holds its outputs, other quantkit artifacts (an earlier recipe's), the bundle and the logs:
    SHA256SUMS seals everything in it, so a file of the user's (notes, data, a ``.env``) would be sealed and shipped
    as part of the release. Refused, naming a few (exit 2). The hidden entries a run leaves (:data:`LEFT_BY_A_RUN`)
    are quantkit's; any other hidden one is the user's, as a visible one is."""
    if not release.is_dir():
        return
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in release.iterdir()
                     if not LEFT_BY_A_RUN.fullmatch(p.name) and p.name not in outputs and p.name not in RELEASE_NAMES
                     and not (p.is_dir() and (p / MANIFEST).is_file()))
    if foreign:
        raise OutputExistsError(f"release folder {release} holds what quantkit did not write: "
                                f"{', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''}; SHA256SUMS would seal "
                                "it into the release", hint=f"move it out of {release}, or choose another output")
