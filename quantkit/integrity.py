"""Whether an artifact's or a release's files are still the ones quantkit sealed, and keeping that seal true when
quantkit writes into a sealed artifact.

An artifact's seal is its manifest's ``files``, every file's sha256 and size (:mod:`quantkit.manifest`); a release
folder's (``quantkit run`` with several outputs) is :data:`SUMS`, in ``sha256sum``'s format, written last.
:func:`verify_tree` is what ``quantkit verify`` and ``inspect`` check: an artifact, a file or a folder inside one,
a release artifact by artifact and then as a whole.

Once sealed, an artifact takes only the files quantkit itself writes there later (``eval``'s reports, the model
card, a one-output release's bundle and logs), told by name and content (:func:`wrote`). :func:`update_manifest`
records a section and seals those files, and refuses, writing nothing, when any other file differs from the seal:
the manifest never vouches for a file quantkit did not write. The same line decides what ``--force`` may remove
with an artifact (:func:`unlisted`).

A module of its own because reading a manifest needs none of this (:mod:`quantkit.manifest`), and writing an
artifact (:mod:`quantkit.artifact`) only asks it what a folder holds besides the artifact's files.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from quantkit import seal
from quantkit.errors import IntegrityError, UsageError
from quantkit.locks import LOCK
from quantkit.manifest import (MANIFEST, MAX_MANIFEST_BYTES, TEMPORARY, EvaluationInfo, FileInfo, Manifest,
                               PipelineInfo, ServingInfo, SmokeInfo, inside_name, is_artifact_file, now_iso,
                               open_regular, read_capped, read_manifest, write_manifest)
from quantkit.progress import fmt_bytes

SUMS = "SHA256SUMS"  # a release folder's seal: every file's sha256 as sha256sum writes them (run writes it last)
REPORT_JSON = "report.json"  # the release's verdict for pipelines
# What quantkit writes beside a release's artifacts (a one-output release: into its artifact), and eval's reports
BUNDLE_FILES = (REPORT_JSON, SUMS, "report.md", "size-vs-ppl.png", "tasks.md")
LOGS = "logs"  # the release's folder of smoke-server and kernel-sweep logs (quantkit run)
MODEL_CARD = "README.md"  # the model card quantkit run writes into each artifact
_SNIFF = 1 << 20  # the most quantkit reads of a file to tell whether it wrote it
_SUM_LINE = re.compile(r"[0-9a-f]{64}  \S.*")
_PNG = b"\x89PNG\r\n\x1a\n"


def _artifact_files(root: Path, under: Path | None = None) -> list[Path]:
    """What an artifact folder holds that its manifest must list (:func:`_entries`), its manifest and locks aside
    (``under``: a folder inside it, that folder's alone)."""
    return [p for p in _entries(under or root) if is_artifact_file(p, root)]


def _entries(root: Path) -> list[Path]:
    """Every entry under ``root`` that is not a folder of it: files (a link to one included) and what a seal cannot
    vouch for but verify must name, a link to a folder (named, not entered: it may lead anywhere), a dangling link,
    a link loop, a FIFO, a socket or a device. Regular files alone (``is_file``) let any of those be added to a
    sealed folder unseen. Nothing is opened, so a FIFO never blocks."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # links to folders are in dirnames, and not followed
        here = Path(dirpath)
        out += [here / name for name in filenames]
        out += [here / name for name in dirnames if (here / name).is_symlink()]
    return sorted(out)


def wrote(path: Path) -> bool:
    """Whether a file at one of the names quantkit writes into a release or an artifact after sealing it
    (:data:`BUNDLE_FILES`, :data:`MODEL_CARD`) is one it wrote, by its content."""
    try:
        with open_regular(path) as f:
            head = f.read(_SNIFF + 1)
    except (OSError, IntegrityError):  # IntegrityError: a FIFO, a socket or a device, refused unread
        return False  # what quantkit cannot read it did not write (and may not replace)
    if len(head) > _SNIFF and path.name != "size-vs-ppl.png":
        return False  # quantkit's reports, sums and cards are far smaller
    if path.name == "size-vs-ppl.png":
        return head.startswith(_PNG) and (b"Matplotlib" in head[:4096] or b"quantkit" in head[:4096])
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if path.name == "report.md":
        return text.startswith("# quantkit evaluation\n")
    if path.name == "tasks.md":
        return text.startswith("# quantkit task accuracy\n")
    if path.name == MODEL_CARD:  # quantkit.pipeline.write_model_card: front matter, then what made it
        return text.startswith("---\n") and "\nQuantized from `" in text and "` with quantkit " in text
    if path.name == SUMS:
        return all(_SUM_LINE.fullmatch(line) for line in text.splitlines() if line)
    if path.name == REPORT_JSON:
        try:
            data = json.loads(text)
        except ValueError:
            return False
        return isinstance(data, dict) and {"release", "outputs"} <= set(data)
    return False


def _left_by_quantkit(root: Path, rel: PurePosixPath) -> bool:
    """Whether a file or folder of an artifact that its manifest does not list is one quantkit writes there after
    sealing it, and seals with :func:`update_manifest` once written: ``run``'s model card, ``eval``'s report and
    plot, ``eval --tasks``'s report, a one-output release's bundle and its smoke and kernel-sweep logs (under
    :data:`LOGS`), or :func:`quantkit.manifest.write_text_atomic`'s temporary file. A run stopped between writing
    one and sealing it leaves it unlisted; ``--force`` may remove these, and nothing else the manifest does not
    list."""
    if TEMPORARY.fullmatch(rel.name) or (rel.parts[:1] == (LOGS,) and (root / rel).is_dir()):
        return True
    return _written_after_seal(rel) and (rel.parts[:1] == (LOGS,) or wrote(root / rel))


def _written_after_seal(rel: PurePosixPath) -> bool:
    """Whether a file's name is one quantkit writes into an artifact after sealing it (:func:`_left_by_quantkit`
    checks the content too): a bundle file or the model card at the top, a log under :data:`LOGS`."""
    if rel.parts[:1] == (LOGS,):
        return len(rel.parts) > 1 and rel.name.endswith((".log", ".request.json"))
    return len(rel.parts) == 1 and rel.name in (*BUNDLE_FILES, MODEL_CARD)


def update_manifest(root: Path, *, evaluation: EvaluationInfo | dict[str, Any] | None = None,
                    smoke: SmokeInfo | dict[str, Any] | None = None,
                    serving: ServingInfo | dict[str, Any] | None = None,
                    pipeline: PipelineInfo | dict[str, Any] | None = None,
                    checked: VerifyResult | None = None) -> Manifest:
    """Replace the sections given (``evaluation``, ``smoke``, ``serving``, ``pipeline``) and seal the files quantkit
    wrote into the artifact since (:func:`resealed_files`), so a report or a model card is never left unhashed.
    Raises :class:`IntegrityError`, writing nothing, when any other file differs from the seal. ``checked``: this
    artifact's verification of a moment ago (:func:`check_intact`), whose unchanged files are not hashed again."""
    manifest = read_manifest(root)
    given = {"evaluation": evaluation, "smoke": smoke, "serving": serving, "pipeline": pipeline}
    update = {k: v for k, v in given.items() if v is not None}
    files = resealed_files(root, manifest, checked.matched if checked else None)
    manifest = Manifest.model_validate({**manifest.model_dump(), **update, "files": files, "updated": now_iso()})
    write_manifest(root, manifest)
    return manifest


def resealed_files(root: Path, manifest: Manifest, known: dict[str, str] | None = None) -> dict[str, FileInfo]:
    """The manifest's ``files`` once quantkit has written into a sealed artifact: the files it writes there after
    sealing (a report, the plot, the model card, a release bundle's files, logs: :func:`_left_by_quantkit`, by
    name and content) get their new sha256, or leave the list when gone; every other file keeps the sha256 it was
    sealed with and must still have it. Re-hashing whatever is on disk instead would seal a changed weight file,
    or a file someone dropped in, as quantkit's: ``verify`` would then vouch for a tampered artifact. Such a
    difference is an :class:`IntegrityError` (exit 1). ``known``: sha256 of files verified a moment ago, taken as
    they are, except the files quantkit may have written since (those are hashed)."""
    known = {rel: d for rel, d in (known or {}).items() if not _written_after_seal(PurePosixPath(rel))}
    check = _against(root, manifest.files, known)
    fresh = sorted(rel for rel in [*check.changed, *check.extra]
                   if not TEMPORARY.fullmatch(PurePosixPath(rel).name) and (root / rel).is_file()  # not a FIFO
                   and _left_by_quantkit(root, PurePosixPath(rel)))
    changed = [rel for rel in check.changed if rel not in fresh]
    extra = [rel for rel in check.extra if rel not in fresh]
    missing = [rel for rel in check.missing if not _written_after_seal(PurePosixPath(rel))]
    if changed or extra or missing:
        raise IntegrityError(f"{root} differs from its {MANIFEST} ({_differences(changed, missing, extra)}): "
                             "not recording into a manifest that would then vouch for files quantkit did not write",
                             hint=f"run `quantkit verify {root}`; re-create the artifact if it was damaged")
    files = {rel: f for rel, f in manifest.files.items() if rel not in check.missing}
    files.update((p.relative_to(root).as_posix(), FileInfo(sha256=d, size=p.stat().st_size))
                 for p, d in seal.hash_many([root / rel for rel in fresh]))
    return dict(sorted(files.items()))


@dataclass
class VerifyResult:
    """What a verification found: files whose hash or size changed, went missing, or are not listed by the seal
    (``seal``: an artifact's manifest, or a release folder's :data:`SUMS`). ``sealed`` is False for a release
    folder without its :data:`SUMS`: ``quantkit run`` writes it last, so its last run did not finish."""

    root: Path
    checked: int = 0
    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    seal: str = MANIFEST
    sealed: bool = True
    matched: dict[str, str] = field(default_factory=dict, repr=False)  # file -> sha256 of those found unchanged

    @property
    def ok(self) -> bool:
        return self.sealed and not (self.changed or self.missing or self.extra)

    def problem(self) -> str:
        """What is wrong, for one line of an error (empty when nothing is)."""
        if not self.sealed:
            return f"no {self.seal} (quantkit run writes it last: its last run on this folder did not finish)"
        found = _differences(self.changed, self.missing, self.extra)
        return f"its files differ from its {self.seal} ({found})" if found else ""

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.root), "ok": self.ok, "seal": self.seal, "sealed": self.sealed,
                "checked": self.checked, "changed": self.changed, "missing": self.missing, "extra": self.extra}


def _compare(root: Path, expected: dict[str, str], sizes: dict[str, int], on_disk: set[str], seal_name: str,
             known: dict[str, str] | None = None) -> VerifyResult:
    """Files under ``root`` against the sha256 their seal lists, and the files on disk it does not list. A size the
    seal records (``sizes``) that differs needs no hashing; a file hashed a moment ago (``known``: a release's
    artifact files, just checked against their manifests) is not hashed again."""
    known = known or {}
    res = VerifyResult(root=root, seal=seal_name)
    inside = root.resolve()
    for rel in expected:
        where = (root / rel).resolve()
        if where != inside and inside not in where.parents:
            raise IntegrityError(f"{root / seal_name} lists {rel}, which a symbolic link leads outside {root} "
                                 f"(to {where}): not a seal of this folder's files")
    missing = {rel for rel in expected if not (root / rel).is_file()}  # a set: looked up once a listed file
    res.missing = sorted(missing)
    res.changed = [rel for rel in expected if rel not in missing and rel in sizes
                   and (root / rel).stat().st_size != sizes[rel]]
    digests = {rel: known[rel] for rel in expected if rel in known and rel not in missing}
    skip = {*res.missing, *res.changed, *digests}
    to_hash = [root / rel for rel in expected if rel not in skip]
    digests.update((p.relative_to(root).as_posix(), d) for p, d in seal.hash_many(to_hash))
    res.changed += [rel for rel, d in digests.items() if d != expected[rel]]
    res.changed.sort()
    res.matched = {rel: d for rel, d in digests.items() if d == expected[rel]}
    res.checked = len(expected) - len(res.missing)
    homes = {parent.as_posix() for rel in expected for parent in PurePosixPath(rel).parents}
    res.extra = sorted(on_disk - expected.keys() - homes)  # a link to a folder of listed files is their way there
    return res


def verify(root: Path) -> VerifyResult:
    """Re-hash every file against the manifest (the artifact's seal). A manifest that is a FIFO is refused, not
    waited on (:func:`quantkit.manifest.read_capped`)."""
    return _against(root, read_manifest(root).files)


def _against(root: Path, files: dict[str, FileInfo], known: dict[str, str] | None = None) -> VerifyResult:
    """Every file of an artifact folder against the ``files`` of its manifest (``known``: see :func:`_compare`)."""
    return _compare(root, {rel: f.sha256 for rel, f in files.items()}, {rel: f.size for rel, f in files.items()},
                    {p.relative_to(root).as_posix() for p in _artifact_files(root)}, MANIFEST, known)


def check_intact(root: Path, doing: str) -> VerifyResult:
    """Refuse to ``doing`` (``smoke-test``) an artifact whose files differ from its manifest, before anything starts:
    what a tampered or damaged artifact gives says nothing of the artifact quantkit wrote, and recording it would
    be refused once the work was done (:func:`update_manifest`)."""
    check = verify(root)
    if not check.ok:
        raise IntegrityError(f"refusing to {doing} {root}: {check.problem()}",
                             hint=f"run `quantkit verify {root}`; re-create the artifact if it was damaged")
    return check


def _differences(changed: list[str], missing: list[str], extra: list[str]) -> str:
    """What a check found, for one line: ``changed ['a'], not listed ['b']``."""
    return "; ".join(f"{what} {names}" for what, names in
                     (("changed", changed), ("missing", missing), ("not listed", extra)) if names)


def beside(folder: Path, name: str) -> Path:
    """Where quantkit puts what it writes about an artifact ``folder`` (the outermost one that holds the path,
    :func:`artifact_of`) unless told: ``FOLDER.NAME`` beside it, never inside it (a smoke's server log, a kernel
    sweep's logs). Where beside it lies inside a release (its folder holds :data:`SUMS`), beside the release instead,
    named after both (``rel.gguf.smoke-llama.cpp.log`` for ``rel/gguf``): written into the release it was a file its
    seal does not list, which the next ``quantkit run`` refused as a file of the user's. Only the folders holding it
    are looked at, one above the other, so a stray ``quantkit.json`` or ``SHA256SUMS`` further up moves nothing."""
    here = Path(os.path.abspath(folder))
    top = here
    while top.parent != top and (top.parent / SUMS).is_file():
        top = top.parent
    if top == here:
        base = folder if folder.name else here
        return base.parent / f"{base.name}.{name}"
    return top.parent / ".".join((top.name, *here.relative_to(top).parts, name))


def holds_manifest(folder: Path) -> bool:
    """Whether ``folder`` holds an entry named :data:`~quantkit.manifest.MANIFEST` that is not a folder: the one test
    of whether a folder claims to be an artifact, which :func:`artifact_of`, :func:`release_artifacts` and
    :func:`quantkit.outputs.check_outside_seals` share, so what one takes for an artifact the others do too. A FIFO
    or a device there counts (looked at, never opened): the folder is then found as the artifact it claims to be,
    and reading its manifest refuses it in one line (:func:`quantkit.manifest.open_regular`) before anything else
    starts, where taking it for no artifact sent ``smoke`` on to look for an engine first, and let ``eval`` write
    its report into the folder."""
    manifest = folder / MANIFEST
    return manifest.exists() and not manifest.is_dir()


def _covers(home: Path, here: Path) -> bool:
    """Whether the manifest of ``home``, a folder above ``here``, really seals ``here``: it is a quantkit manifest
    and lists the entry of ``home`` that ``here`` is, or is in (a file of it, or a folder holding files it lists).
    Such a manifest seals everything under that entry, a file it does not list included (reported as not listed),
    so a manifest in a folder it covers is one of its files, never the seal. A ``quantkit.json`` read and found to
    be no quantkit manifest (not JSON, another tool's file, too large) seals nothing and covers nothing. One that
    cannot be read (a FIFO or a device, never opened; no permission; a newer schema) might list ``here``, so it is
    taken to cover it: whoever reads it next says why it cannot be, in one line, rather than checking ``here``
    against a manifest nested below it."""
    try:
        files = read_manifest(home).files
    except UsageError:  # a newer schema (or removed meanwhile)
        return True
    except IntegrityError:  # read and no manifest, or not read at all
        return not _readable_file(home / MANIFEST)
    top = here.relative_to(home).parts[0]
    return any(name.split("/", 1)[0] == top for name in files)


def _readable_file(path: Path) -> bool:
    """Whether ``path`` is a regular file this process may read (looked at, not opened): what a reader failing on
    it then found in its content, not in the way to it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode) and os.access(path, os.R_OK)
    except OSError:
        return False


def artifact_of(path: Path) -> Path | None:
    """The artifact folder whose seal covers a path: the outermost manifest that really covers it. A manifest above
    the path's own folder covers it when it lists the entry of its folder on the path's way (:func:`_covers`: a
    file it lists, or a folder holding files it lists, such as the ``gptq/`` or ``autoawq/`` legacy layout of
    ``--format gptq`` or ``--format autoawq``); failing that, the manifest of the path's own folder covers it (the
    path itself for a folder, the folder a file is in: a ``.gguf`` beside its ``quantkit.json``, a file added
    there, which verify names as not listed, or that ``quantkit.json`` itself, the whole seal).

    Outermost, because an artifact's manifest seals every file under what it lists, a ``quantkit.json`` in a
    subfolder included (a user's nested folder): taking the nearest one, ``verify ART/sub`` checked the subfolder
    against a forged manifest put beside tampered files, and passed. Covering, because a ``quantkit.json`` above
    that lists nothing on the way (a stray ``~/quantkit.json``, not a manifest at all or another folder's) vouches
    for nothing under it: taking it for the seal refused every good artifact below, and gave a file or a checkpoint
    below it a manifest not its own. So a folder of the user's inside an artifact that lists nothing
    in it is covered by no seal, nor are the files in it, unless it holds a manifest of its own (an artifact put
    there, whose files ``verify`` of the outer one names as not listed). A release folder (``quantkit run``'s,
    sealed by its ``SHA256SUMS``, no manifest of its own) is no artifact: ``RELEASE/ART`` is ART's.

    Given as an absolute path where it is not ``path`` itself (callers take its ``name``, which ``.`` has not).
    None when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    here = Path(os.path.abspath(path))
    own = here if path.is_dir() else here.parent
    marked = [d for d in (own, *own.parents) if holds_manifest(d)]  # nearest first
    for home in reversed(marked):
        if home == own or _covers(home, here):
            return path if home == here else home
    return None


def verify_file(path: Path) -> VerifyResult:
    """One file of an artifact, or a folder inside one (every file under it, and every file the manifest lists
    there), against the manifest of its artifact (:func:`artifact_of`)."""
    root = artifact_of(path)
    if root is None:
        raise UsageError(f"{path} is in no folder with a {MANIFEST} that seals it: its folder holds none, and none "
                         "above lists it (it was not written by quantkit, or is incomplete)",
                         hint="give an artifact folder, or a file inside one; verify the artifact folder to see "
                         "what it does not list")
    path = Path(path)
    # the manifest itself (or a lock file): the artifact's seal as a whole
    if not path.is_dir() and not is_artifact_file(path, root):
        return verify(root)
    part = PurePosixPath(Path(os.path.abspath(path)).relative_to(os.path.abspath(root)).as_posix())
    files = {k: f for k, f in read_manifest(root).files.items() if k == str(part) or part in PurePosixPath(k).parents}
    on_disk = {p.relative_to(root).as_posix() for p in _artifact_files(root, root / part)} if path.is_dir() \
        else {str(part)}
    return _compare(root, {k: f.sha256 for k, f in files.items()}, {k: f.size for k, f in files.items()}, on_disk,
                    MANIFEST)


def release_artifacts(folder: Path) -> list[Path]:
    """The artifact folders of a release folder (``quantkit run``'s output of several outputs: one folder each,
    with its manifest); [] for a folder that is itself an artifact or holds none."""
    folder = Path(folder)
    if not folder.is_dir() or holds_manifest(folder):
        return []
    return sorted(p.parent for p in folder.glob(f"*/{MANIFEST}"))


def release_files(release: Path) -> list[Path]:
    """The files a release's :data:`SUMS` lists: every file under it but that list and what quantkit leaves there
    unsealed (:func:`_release_entries`)."""
    return [p for p in _release_entries(release) if p.is_file()]


def _release_entries(release: Path) -> list[Path]:
    """What a release folder holds that its :data:`SUMS` must list (:func:`_entries`): all but that list, a killed
    run's lock files (``.NAME.lock``, :func:`quantkit.locks.output_lock`) and temporary files (:data:`TEMPORARY`).
    Other hidden files are listed: leaving every dot-file out let a ``.env`` added to a sealed release pass."""
    return [p for p in _entries(release) if p.name != SUMS and not TEMPORARY.fullmatch(p.name)
            and not LOCK.fullmatch(p.name)]


def _read_sums(path: Path) -> dict[str, str]:
    """``sha256sum``'s lines (``<sha256>  <file>``, ``*`` before the file in binary mode) as file -> sha256;
    a line of any other shape, or naming a file outside the folder, is an :class:`IntegrityError`."""
    raw = read_capped(path, MAX_MANIFEST_BYTES)
    if raw is None:
        raise IntegrityError(f"{path} is larger than {fmt_bytes(MAX_MANIFEST_BYTES)}: not a list of sha256")
    sums: dict[str, str] = {}
    for n, line in enumerate(raw.decode(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ") if "  " in line else line.partition(" *")
        if not (sep and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) and inside_name(name)):
            raise IntegrityError(f"{path}, line {n}: not '<sha256>  <file>' with a file inside the folder: "
                                 f"{line[:120]!r}")
        sums[PurePosixPath(name).as_posix()] = digest
    return sums


def verify_release(release: Path, known: dict[str, str] | None = None) -> VerifyResult:
    """A release folder against its :data:`SUMS`: every file it lists is there with that sha256, and every file of
    the release is listed (``known``: files already hashed, by their path in the release). No :data:`SUMS` at all:
    not sealed."""
    release = Path(release)
    if not (release / SUMS).is_file():
        return VerifyResult(root=release, seal=SUMS, sealed=False)
    on_disk = {p.relative_to(release).as_posix() for p in _release_entries(release)}
    return _compare(release, _read_sums(release / SUMS), {}, on_disk, SUMS, known)


def verify_tree(path: Path) -> list[VerifyResult]:
    """What ``quantkit verify`` checks: an artifact folder against its manifest, a file or a folder inside one
    against the manifest of its artifact, a release folder artifact by artifact and then as a whole against its
    :data:`SUMS`."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist", hint="give an artifact folder, a file inside one, or a release "
                         "folder")
    if not path.is_dir():  # a file (a FIFO too, refused when read) against the manifest of its artifact
        return [verify_file(path)]
    home = artifact_of(path)
    if home == path:
        return [verify(path)]
    if home is not None:  # a folder inside an artifact: a legacy layout's copy, a folder with a nested manifest
        return [verify_file(path)]
    roots = release_artifacts(path)
    if not roots:
        raise UsageError(f"{path} has no {MANIFEST} (and no artifact folders holding one)",
                         hint="give an artifact folder, a file inside one, or a release folder")
    results = [verify(r) for r in roots]
    known = {f"{r.root.name}/{rel}": digest for r in results for rel, digest in r.matched.items()}
    return [*results, verify_release(path, known)]


def unlisted(root: Path, manifest: Manifest) -> list[str]:
    """What an artifact folder holds besides the files its manifest lists and what quantkit left there
    (:func:`_left_by_quantkit`): files, links and empty folders of the user's, each named by its top-most folder
    that holds nothing of the artifact (``mydata/``, not every file in it). Links are not followed."""
    ours = {PurePosixPath(name) for name in manifest.files} | {PurePosixPath(MANIFEST)}
    homes = {parent for name in ours for parent in name.parents}  # the folders the artifact's files are in
    theirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = PurePosixPath(Path(dirpath).relative_to(root).as_posix())
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        entries = [*filenames, *links] + ([] if dirnames or filenames else [""])  # "": an empty folder itself
        for name in entries:
            rel = here / name if name else here
            if rel in ours or rel in homes or _left_by_quantkit(root, rel):
                continue
            # the top-most folder on its way that is neither the artifact's nor quantkit's (rel itself at the latest)
            top = next(p for p in [*reversed(rel.parents), rel] if p not in homes and not _left_by_quantkit(root, p))
            theirs.add(top.as_posix() + ("/" if top != rel or not name else ""))
    return sorted(theirs)
