"""Task accuracy (``quantkit eval --tasks``, quantkit/tasks/): the real SmolLM2 and its artifacts scored by lm-eval
on the shipped tasks, through transformers and through llama-server, and every refusal before any model loads.

The refusals are the cli tier (they load nothing); the rest is e2e. Each eval is a real ``quantkit`` process with
its own cache folder, on a few items of a task (``--limit``): the figures are what the code computed, checked
against each other (recovery = artifact / baseline), never against fixed numbers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY

pytestmark = pytest.mark.e2e
pytest.importorskip("lm_eval")

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a shared 2-core machine: one torch thread each is faster than two


def _env(tmp: Path) -> dict[str, str]:
    return {**ONE_THREAD, "QUANTKIT_CACHE_DIR": str(tmp / "cache")}


def _error_lines(proc: Any) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def _refused(proc: Any, *words: str) -> str:
    """Exit 2 with one error line holding ``words``, and no model loaded on the way."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.cli
def test_unparsable_task_file_refused(smollm2: Path, tmp_path: Path, cli: Callable) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    proc = cli("eval", smollm2, "--baseline", smollm2, "--tasks", bad, env=_env(tmp_path))
    _refused(proc, str(bad), "does not parse")


@pytest.mark.cli
def test_unknown_task_name_refused_offline(smollm2: Path, tmp_path: Path, cli: Callable) -> None:
    proc = cli("eval", smollm2, "--baseline", smollm2, "--tasks", "quantkit_no_such_task", env=_env(tmp_path))
    _refused(proc, "does not know a task called 'quantkit_no_such_task'")


@pytest.mark.cli
def test_metric_the_task_does_not_report_refused(smollm2: Path, tmp_path: Path, cli: Callable) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {smollm2}}}\noutput: {tmp_path / 'out'}\nquantize: {{method: rtn}}\n"
                      "evaluation:\n  tasks:\n    - {task: quantkit_lastword, min_recovery: {acc_norm: 0.9}}\n")
    proc = cli("eval", smollm2, "--baseline", smollm2, "--tasks", "quantkit_lastword", "--recipe", recipe,
               env=_env(tmp_path))
    _refused(proc, "quantkit_lastword does not report the metric 'acc_norm'", "it reports: acc")


@pytest.mark.cli
def test_perplexity_flags_with_tasks_refused(tmp_path: Path, cli: Callable) -> None:
    """``--tasks`` replaces the perplexity evaluation: its flags and gates were dropped without a word (``--tasks T
    --max-kld 0.1`` exited 0, no KLD computed), while the task flags without ``--tasks`` were refused. Both ways are
    now one line naming every flag that does not apply, exit 2, before anything loads."""
    report = tmp_path / "report"
    proc = cli("eval", TINY, "--baseline", TINY, "--tasks", "quantkit_lastword", "--limit", "2", "--max-kld", "0.1",
               "--ctx", "512", "--dataset", "heldout", "--stride", "64", "--max-tokens", "64", "--numerics", "auto",
               "--max-ppl-ratio", "2", "--min-top1", "0.5", "--report-dir", report, env=_env(tmp_path))
    line = _refused(proc, "--dataset, --ctx, --stride, --max-tokens, --numerics, --max-ppl-ratio, --max-kld and "
                          "--min-top1 do not apply to --tasks")
    assert "--limit" not in line and not report.exists()
    _refused(cli("eval", TINY, "--tasks", "quantkit_lastword", "--ctx", "512", env=_env(tmp_path)),
             "--ctx does not apply to --tasks")
    _refused(cli("eval", TINY, "--limit", "2", "--min-recovery", "0.9", env=_env(tmp_path)),
             "--limit and --min-recovery do not apply to an eval without --tasks")


@pytest.mark.cli
def test_recipe_task_problems_reported_together_with_field_and_line(tmp_path: Path, cli: Callable) -> None:
    """A recipe's task problems came one at a time (the second only once the first was fixed), with no file, field
    or line: now every one, as the schema's problems are reported, in ``run --dry-run`` and under ``--json``."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {TINY}}}\noutput: out\noutputs:\n  - {{method: rtn}}\n"
                      "evaluation:\n  tasks:\n    - {task: quantkit_no_such_task}\n"
                      "    - task: quantkit_nextsentence\n      min_recovery: {exact_match: 0.9, acc_norm: 0.9}\n"
                      "    - {task: quantkit_lastword, min_recovery: {acc: 0.9}}\n")
    proc = cli("run", recipe.name, "--dry-run", "--json", cwd=tmp_path, env=_env(tmp_path))
    line = _refused(proc, "r.yaml: invalid recipe")
    lines = proc.stderr.splitlines()
    problems = lines[lines.index(line) + 1:]
    assert "evaluation.tasks.0.task (line 7): lm-eval" in problems[0] and "'quantkit_no_such_task'" in problems[0]
    assert problems[1].strip() == ("evaluation.tasks.1.min_recovery (line 9): task quantkit_nextsentence does not "
                                   "report the metric 'exact_match'; it reports: acc, acc_norm"), proc.stderr
    assert problems[2].strip().startswith("hint:"), "the good task has no problem"
    assert json.loads(proc.stdout)["error"] == "\n".join([line.removeprefix("error: "), *problems[:2]])


def _tasks(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "quantkit.json").read_text())["evaluation"]["tasks"]


def test_transformers_recovery_recorded_cached_and_gated(smollm2_rtn: Path, tmp_path: Path, cli: Callable) -> None:
    """The baseline is scored once: the second artifact's eval reads it from the cache, says so, and a gate above
    reach fails (exit 3) naming the task, the metric and both scores."""
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(smollm2_rtn, first)
    shutil.copytree(smollm2_rtn, second)
    args = ("--tasks", "quantkit_lastword", "--limit", "6", "--json")
    proc = cli("eval", first, *args, env=_env(tmp_path), check=True)
    rec = _tasks(first)
    row = rec["rows"][0]
    assert (row["task"], row["metric"], row["samples"], row["num_fewshot"]) == ("quantkit_lastword", "acc", 6, 0)
    assert row["baseline"] > 0, "SmolLM2 finds some last words: a zero baseline would leave recovery undefined"
    assert row["recovery"] == pytest.approx(row["artifact"] / row["baseline"])
    assert row["baseline_stderr"] is not None and row["task_sha256"] == rec["tasks"][0]["sha256"]
    assert rec["baseline"]["cached"] is False and rec["engine"]["engine"] == "transformers"
    assert json.loads(proc.stdout)["passed"] is True
    assert cli("verify", first).returncode == 0, "the manifest's update re-sealed the folder"

    proc = cli("eval", second, *args, "--min-recovery", "1.5", env=_env(tmp_path))
    assert proc.returncode == 3, proc.stderr[-2000:]
    again = _tasks(second)
    assert again["baseline"]["cached"] is True, "the baseline was scored again instead of read from the cache"
    assert again["rows"][0]["baseline"] == row["baseline"]
    assert again["rows"][0]["artifact"] == row["artifact"], "the same artifact scored the same"
    assert "baseline in transformers: quantkit_lastword from the cache" in proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "quantkit_lastword acc:" in ln)
    assert f"artifact {row['artifact']:.4f}, baseline {row['baseline']:.4f}" in line and "(min 1.5)" in line
    assert json.loads(proc.stdout)["passed"] is False
    assert (tmp_path / "b" / "tasks.md").read_text().startswith("# quantkit task accuracy\n")


def test_zero_baseline_gate_names_the_real_cause(tiny_rtn: Path, tmp_path: Path, cli: Callable) -> None:
    """The QA report's case: the reference model against its RTN artifact as the baseline, which finds none of the
    first two last words while the model finds one. Recovery is undefined and the gate fails (documented), and the
    hint said the artifact did the task worse; it now names the baseline's zero and what to change."""
    proc = cli("eval", TINY, "--baseline", tiny_rtn, "--tasks", "quantkit_lastword_gen", "--limit", "2",
               "--min-recovery", "0.9", "--report-dir", tmp_path / "report", "--json", env=_env(tmp_path))
    assert proc.returncode == 3, proc.stderr[-2000:]
    row = json.loads(proc.stdout)["rows"][0]
    assert (row["baseline"], row["recovery"]) == (0, None) and row["artifact"] > 0, \
        f"the case needs a baseline scoring 0 and an artifact scoring more: {row}"
    hint = next(ln for ln in proc.stderr.splitlines() if "hint:" in ln)
    assert "the baseline scores 0" in hint and "raise --limit" in hint and "worse" not in hint, hint
    assert "recovery undefined (baseline 0) (min 0.9)" in proc.stderr


def test_gguf_generation_task_through_llama_server(smollm2_gguf: Path, tmp_path: Path, cli: Callable) -> None:
    art = tmp_path / "gguf"
    shutil.copytree(smollm2_gguf, art)
    cli("eval", art, "--tasks", "quantkit_lastword_gen", "--limit", "6", env=_env(tmp_path), check=True)
    rec = _tasks(art)
    row = rec["rows"][0]
    assert (row["engine"], row["metric"], row["samples"]) == ("llama.cpp", "exact_match,first-word", 6)
    assert rec["engine"]["engine"] == "llama.cpp" and rec["baseline"]["engine"]["engine"] == "transformers"
    assert row["baseline"] > 0 and row["recovery"] == pytest.approx(row["artifact"] / row["baseline"])


def test_loglikelihood_task_on_gguf_refused(smollm2_gguf: Path, tmp_path: Path, cli: Callable) -> None:
    proc = cli("eval", smollm2_gguf, "--tasks", "quantkit_lastword", env=_env(tmp_path))
    _refused(proc, "quantkit_lastword is a loglikelihood task", "llama-server refuses echo")
    assert "tasks" not in (json.loads((smollm2_gguf / "quantkit.json").read_text()).get("evaluation") or {})
