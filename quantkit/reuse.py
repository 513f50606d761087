"""Whether an artifact folder already holds an output, complete and made the same way (``quantkit run``'s resume).

Beside the artifact, below the pipeline and the plan: ``run`` reuses what this says is complete, and ``--dry-run``
says "reuse" for exactly the same folders. An artifact is rebuilt when the output's recipe, the source model (its
config, its weights' bytes or its revision) or a library that changes the artifact's bytes differs from what its
manifest recorded, or when its files no longer hash to the manifest. The weights are compared by their sha256
(:meth:`quantkit.source.SourceModel.weights_sha256`, hashed once per version of each file): a checkpoint re-exported
or fine-tuned in place keeps its config.json, and an artifact of its old weights must not ship with its old "pass".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quantkit import integrity, versions
from quantkit.manifest import MANIFEST, read_manifest

if TYPE_CHECKING:
    from quantkit.formats.specs import MethodBase
    from quantkit.recipe import Recipe
    from quantkit.source import SourceModel

# Library versions that change an artifact's bytes: a difference means the artifact is rebuilt.
PRODUCER_LIBS = ("llmcompressor", "compressed-tensors", "transformers", "torch", "gguf", "llama_cpp_python",
                 "autoawq", "nvidia-modelopt")


def reusable(recipe: Recipe, spec: MethodBase, out: Path, src: SourceModel) -> tuple[bool, str]:
    """Whether ``out`` already holds this output, complete and made the same way; and why not."""
    if not (out / MANIFEST).exists():
        return False, "no manifest"
    m = read_manifest(out)
    if m.output_sha256 != recipe.output_sha256(spec):
        return False, "the recipe for this output changed"
    if m.source.config_sha256 != src.config_sha256:
        return False, "the source model changed"
    if m.source.weights_sha256 is None:
        return False, "its manifest does not record the source's weights (made by an older quantkit)"
    if m.source.weights_sha256 != src.weights_sha256():
        return False, "the source model's weights changed"
    if m.source.revision != src.revision:
        return False, "the source revision changed"
    now = versions.installed(PRODUCER_LIBS)
    then = {k: v for k, v in m.versions.items() if k in PRODUCER_LIBS}
    if now != then:
        diff = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
        return False, f"library versions changed ({', '.join(diff)})"
    if not integrity.verify(out).ok:
        return False, "files differ from the manifest"
    return True, "complete, same recipe, source and versions"
