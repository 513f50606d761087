"""Upload verified artifacts to the Hugging Face hub (``quantkit publish``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit import artifact
from quantkit.errors import IntegrityError, QuantkitError, UnsafeOutputError, UsageError


def publish(folder: Path, repo: str, *, private: bool = False) -> list[dict[str, Any]]:
    """Verify then upload each artifact under ``folder``; a release folder maps to ``repo-<artifact>`` repos."""
    if (folder / artifact.MANIFEST).exists():
        targets = [(folder, repo)]
    else:
        targets = [(p.parent, f"{repo}-{p.parent.name}") for p in sorted(folder.glob(f"*/{artifact.MANIFEST}"))]
    if not targets:
        raise UsageError(f"{folder} holds no quantkit artifact (no {artifact.MANIFEST})")
    for path, _ in targets:
        res = artifact.verify(path)
        if not res.ok:
            raise IntegrityError(f"refusing to publish {path}: files differ from the manifest "
                                 f"(changed {res.changed}, missing {res.missing}, extra {res.extra})")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

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
        except OSError as e:
            raise QuantkitError(f"cannot reach the Hugging Face hub to upload {path}: {e}",
                                hint="check the network; the artifacts are unchanged on disk") from None
        done.append({"path": str(path), "repo": repo_id, "url": str(getattr(info, "commit_url", info))})
    return done


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
