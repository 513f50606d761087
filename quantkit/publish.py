"""Upload verified artifacts to the Hugging Face hub (``quantkit publish``).

Everything that can be checked here is checked before the hub is asked: the repository ids (huggingface_hub's own
validator), every artifact's files against its manifest, and that there is a token to upload with. Tested with
huggingface_hub 1.33.0, whose requests go through httpx: a hub that cannot be reached raises httpx's transport errors
(a refused connection, a name that does not resolve, a timeout), an answer it refuses raises ``HfHubHTTPError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit import artifact
from quantkit.errors import IntegrityError, QuantkitError, UnsafeOutputError, UsageError


def publish(folder: Path, repo: str, *, private: bool = False) -> list[dict[str, Any]]:
    """Verify then upload each artifact under ``folder``; a release folder maps to ``repo-<artifact>`` repos."""
    _check_repo_id(repo)
    if (folder / artifact.MANIFEST).exists():
        targets = [(folder, repo)]
    else:
        targets = [(p, f"{repo}-{p.name}") for p in artifact.release_artifacts(folder)]
    if not targets:
        raise UsageError(f"{folder} holds no quantkit artifact (no {artifact.MANIFEST})")
    for path, repo_id in targets:
        _check_repo_id(repo_id)
        res = artifact.verify(path)
        if not res.ok:
            raise IntegrityError(f"refusing to publish {path}: files differ from the manifest "
                                 f"(changed {res.changed}, missing {res.missing}, extra {res.extra})")
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
    if [f for f in files if f != ".gitattributes"] and artifact.MANIFEST not in files:
        raise UnsafeOutputError(f"hub repository {repo_id} holds files that quantkit did not publish (no "
                                f"{artifact.MANIFEST})", hint="publish to another repository, or empty that one "
                                "yourself")
