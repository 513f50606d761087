"""What ``quantkit run --dry-run`` says of an output not made yet is what the run then does with the folder it
makes: here, the one rule of which engine reads which kind (GGUF is llama.cpp's, and llama.cpp reads nothing else,
:func:`quantkit.engines.logits.kind_refusal`). A recipe naming llama.cpp for a Hugging Face output, or transformers
for a GGUF one, was planned as an evaluation and a smoke test in that engine, and then skipped by the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import TINY, quantkit
from quantkit.engines import logits
from quantkit.formats.names import LLAMACPP, TRANSFORMERS, VLLM, KindName

pytestmark = pytest.mark.cli

RTN = {"method": "rtn"}
GGUF = {"method": "gguf", "types": ["Q8_0"]}


def _recipe(work: Path, outputs: list[dict], evaluates: str, serves: str) -> None:
    (work / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"source": str(TINY)}, "output": "release", "outputs": outputs,
        "evaluation": {"dataset": "heldout", "max_tokens": 1024, "engine": evaluates},
        "smoke": {"engine": serves}}))


def _plan(work: Path) -> list[dict]:
    """The plan's outputs, in the recipe's order."""
    proc = quantkit("run", "recipe.yaml", "--dry-run", "--json", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["outputs"]


def test_the_plan_foresees_which_engine_reads_which_kind_as_the_run_does(tmp_path: Path) -> None:
    """llama.cpp named for an RTN output and a GGUF one: the plan skips the RTN output's evaluation and smoke test in
    the words of the run's check, and plans the GGUF's; transformers and vLLM named: the reverse. The run of the RTN
    output then records exactly the skips its plan said."""
    _recipe(tmp_path, [RTN, GGUF], LLAMACPP, LLAMACPP)
    rtn, gguf = _plan(tmp_path)
    refused = logits.kind_refusal(LLAMACPP, KindName.COMPRESSED_TENSORS, Path(rtn["path"]))
    assert refused is not None
    assert rtn["evaluate"] == rtn["smoke"] == f"skipped ({refused.message})", rtn
    assert gguf["evaluate"].startswith("llama.cpp, heldout") and gguf["smoke"].startswith("llama.cpp server"), gguf

    _recipe(tmp_path, [RTN, GGUF], TRANSFORMERS, VLLM)
    rtn, gguf = _plan(tmp_path)
    for engine, column in ((TRANSFORMERS, "evaluate"), (VLLM, "smoke")):
        refused = logits.kind_refusal(engine, KindName.GGUF, Path(gguf["path"]))
        assert refused is not None and "is GGUF" in refused.message
        assert gguf[column] == f"skipped ({refused.message})", gguf
    assert rtn["evaluate"].startswith("transformers, heldout") and rtn["smoke"].startswith("vllm server"), rtn

    _recipe(tmp_path, [RTN], LLAMACPP, LLAMACPP)
    (said,) = _plan(tmp_path)
    proc = quantkit("run", "recipe.yaml", "--json", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = json.loads(proc.stdout)["outputs"]
    assert out["status"] == "built"
    for step, column in ((out["evaluation"], said["evaluate"]), (out["smoke"], said["smoke"])):
        assert step["status"] == "skipped" and f"skipped ({step['summary']})" == column, (step, column)
