"""Upload verified artifacts to the Hugging Face hub (``quantkit publish``).

Everything that can be checked here is checked before the hub is asked: the repository ids (huggingface_hub's own
validator), the folder as ``quantkit verify`` checks it (every artifact against its manifest; a release, then, against
its SHA256SUMS: a release without one is a run that did not finish), the release's verdict (``report.json``: a release
whose gates failed is not published, exit 3), and that there is a token to upload with. Tested with
huggingface_hub 1.33.0, whose requests go through httpx: a hub that cannot be reached raises httpx's transport errors
(a refused connection, a name that does not resolve, a timeout), an answer it refuses raises ``HfHubHTTPError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit import integrity
from quantkit.errors import GateFailedError, IntegrityError, QuantkitError, UnsafeOutputError, UsageError
from quantkit.manifest import MANIFEST, MAX_MANIFEST_BYTES, read_capped


def publish(folder: Path, repo: str, *, private: bool = False) -> list[dict[str, Any]]:
    """Verify then upload each artifact under ``folder``; a release folder maps to ``repo-<artifact>`` repos."""
    _check_repo_id(repo)
    if (folder / MANIFEST).exists():
        targets = [(folder, repo)]
    else:
        targets = [(p, f"{repo}-{p.name}") for p in integrity.release_artifacts(folder)]
    if not targets:
        raise UsageError(f"{folder} holds no quantkit artifact (no {MANIFEST})")
    for _, repo_id in targets:
        _check_repo_id(repo_id)
    bad = [r for r in integrity.verify_tree(folder) if not r.ok]
    if bad:
        raise IntegrityError(f"refusing to publish {folder}: " + "; ".join(f"{r.root}: {r.problem()}" for r in bad),
                             hint=f"run `quantkit verify {folder}`; re-run what made it if it was cut short or damaged")
    _check_verdict(folder)
    import httpx
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    if get_token() is None:
        raise UsageError("publish needs a Hugging Face token with write access, and none is set",
                         hint="run `hf auth login`, or set HF_TOKEN")
    api = HfApi()
    done = []
    for path, repo_id in targets:
        try:
            _check_repo(api, repo_id)
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(folder_path=str(path), repo_id=repo_id,
                                     commit_message=f"quantkit: upload {path.name}")
        except HfHubHTTPError as e:
            raise QuantkitError(f"upload of {path} to {repo_id} failed: {e}",
                                hint="check `hf auth whoami` and your write access") from None
        except (httpx.TransportError, OSError) as e:
            raise QuantkitError(f"cannot reach the Hugging Face hub to upload {path}: {e}",
                                hint="check the network; the artifacts are unchanged on disk") from None
        done.append({"path": str(path), "repo": repo_id, "url": str(getattr(info, "commit_url", info))})
    return done


def _check_verdict(folder: Path) -> None:
    """A release ``quantkit run`` judged failed (its ``report.json``, checked against the seal first, says ``ok``
    false) is not published: a failed gate is exit 3, a failed output, evaluation or smoke test exit 1. A folder
    without a ``report.json`` (an artifact made by a quantize verb) has no verdict to check."""
    path = folder / integrity.REPORT_JSON
    if not path.is_file():
        return
    try:
        raw = read_capped(path, MAX_MANIFEST_BYTES)
        report = json.loads(raw) if raw is not None else None
    except (OSError, ValueError):
        report = None
    if not isinstance(report, dict):
        raise IntegrityError(f"refusing to publish {folder}: {path} is not a quantkit run report")
    if report.get("ok") is True:
        return
    hint = f"see {folder / 'report.md'}; fix what failed and run the recipe again"
    if gates := report.get("failed_gates"):
        raise GateFailedError(f"refusing to publish {folder}: its last quantkit run failed verification gates: "
                              + "; ".join(map(str, gates)), hint=hint)
    raise QuantkitError(f"refusing to publish {folder}: its last quantkit run did not pass ({integrity.REPORT_JSON} "
                        f"says ok: {json.dumps(report.get('ok'))}: an output, its evaluation or its smoke test "
                        "failed)", hint=hint)


def _check_repo_id(repo_id: str) -> None:
    """A repository id the hub accepts (ORG/NAME or NAME: letters, digits, ``-_.``, at most 96 characters)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UsageError(f"--repo {repo_id!r} is not a Hugging Face repository id: {' '.join(str(e).split())}",
                         hint="give ORG/NAME, e.g. --repo my-org/my-model-awq") from None


def _check_repo(api: Any, repo_id: str) -> None:
    """An upload overwrites files of the same name: publish only into a new repository, an empty one, or one that
    holds a quantkit artifact (its ``quantkit.json``), never over a model someone else put there."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        files = api.list_repo_files(repo_id)
    except RepositoryNotFoundError:
        return
    if [f for f in files if f != ".gitattributes"] and MANIFEST not in files:
        raise UnsafeOutputError(f"hub repository {repo_id} holds files that quantkit did not publish (no "
                                f"{MANIFEST})", hint="publish to another repository, or empty that one "
                                "yourself")
