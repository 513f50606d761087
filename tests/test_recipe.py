"""Recipe validation: every error names the field, the line (or flag) and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit import recipe
from quantkit.errors import RecipeError
from quantkit.outputs import RELEASE_NAMES

pytestmark = pytest.mark.unit

GOOD = """\
model:
  source: models/quantkit-tiny
output: out/awq
quantize:
  method: awq
  bits: 4
  group_size: 128
calibration:
  dataset: mixed
  samples: 16
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def error_of(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(RecipeError) as e:
        recipe.load(write(tmp_path, text), overrides, check_output_escape=False)
    return str(e.value)


def test_good_recipe_fills_defaults(tmp_path: Path) -> None:
    r = recipe.load(write(tmp_path, GOOD), check_output_escape=False)
    assert r.quantize.method == "awq" and r.quantize.symmetric is False
    assert r.quantize.ignore == [] and r.quantize.default_ignore is True
    assert r.calibration.samples == 16 and r.calibration.seq_len == 512
    assert r.artifacts() == [(r.quantize, Path("out/awq"))]


def test_unknown_key_names_field_and_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("  bits: 4", "  bitz: 4"))
    assert "quantize.bitz" in msg and "line 6" in msg and "unknown key" in msg


def test_wrong_type_names_field_line_and_value(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("samples: 16", "samples: many"))
    assert "calibration.samples" in msg and "line 10" in msg and "'many'" in msg and "integer" in msg


@pytest.mark.parametrize("old,new,where", [
    ("  bits: 4", "  bits: 5", "quantize.bits (line 6): expected 4 or 8"),
    ("  group_size: 128", "  group_size: 100", "quantize.group_size (line 7): must be one of"),
])
def test_out_of_range_values(tmp_path: Path, old: str, new: str, where: str) -> None:
    assert where in error_of(tmp_path, GOOD.replace(old, new))


@pytest.mark.parametrize("flag,value,why", [
    ("runtime.device|--device", "tpu", "runtime.device (from --device)"),  # ran on the CPU and recorded "tpu"
    ("runtime.device|--device", "cuda:x", "runtime.device (from --device)"),
    ("runtime.seed|--seed", -1, "runtime.seed (from --seed): Input should be greater than or equal to 0"),
])
def test_a_flag_value_quantkit_would_not_honour_is_refused(tmp_path: Path, flag: str, value: object,
                                                          why: str) -> None:
    """A device that is not one quantkit runs on, or a negative seed (Python's random draws with -n as with n, so
    the manifest would record a seed other than the one that drew the samples), is refused, not recorded."""
    assert why in error_of(tmp_path, GOOD, {flag: value})
    for ok in ("cpu", "cuda", "cuda:3", "auto"):
        assert recipe.load(write(tmp_path, GOOD), {"runtime.device|--device": ok},
                           check_output_escape=False).runtime.device == ok


def test_unknown_method_lists_methods(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("method: awq", "method: awk"))
    assert "quantize" in msg and "'awq'" in msg and "'gguf'" in msg and "line 4" in msg


def test_flag_override_is_validated_and_named(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD, {"quantize.bits|--bits": 3})
    assert "quantize.bits" in msg and "--bits" in msg
    r = recipe.load(write(tmp_path, GOOD), {"output|-o": "elsewhere", "quantize.bits|--bits": 8},
                    check_output_escape=False)
    assert r.output == "elsewhere" and r.quantize.bits == 8


def test_a_refusal_names_the_command_line_only_when_a_flag_was_given(tmp_path: Path) -> None:
    bad = GOOD.replace("  bits: 4", "  bits: 5")
    assert error_of(tmp_path, bad, {"output|--output": None}).startswith(f"{tmp_path / 'r.yaml'}: quantize.bits")
    assert error_of(tmp_path, bad, {"output|--output": "o"}).startswith(f"{tmp_path / 'r.yaml'} + command line: ")


def test_invalid_yaml_gives_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "model:\n  source: [unclosed\noutput: x\n")
    assert "not valid YAML" in msg and "line" in msg


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "model: !!python/object/apply:os.system ['echo pwned']\noutput: x\n")
    assert "not valid YAML" in msg


def test_output_escaping_the_working_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    p = write(tmp_path, GOOD.replace("output: out/awq", "output: ../../etc/quantkit"))
    with pytest.raises(RecipeError, match="outside the working folder"):
        recipe.load(p)
    # An explicit -o from the user is their choice, not the recipe's.
    assert recipe.load(p, {"output|-o": str(tmp_path / "ok")}).output == str(tmp_path / "ok")


def test_quantize_and_outputs_are_exclusive(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD + "outputs:\n  - method: rtn\n")
    assert "exactly one of 'quantize'" in msg


@pytest.mark.parametrize("outputs", ["[]", "\n  []"])
def test_a_recipe_makes_at_least_one_output(tmp_path: Path, outputs: str) -> None:
    msg = error_of(tmp_path, f"model: {{source: m}}\noutput: rel\noutputs: {outputs}\n")
    assert "outputs (line 3): no outputs: a recipe makes at least one artifact" in msg and "\n" not in msg, msg


@pytest.mark.cli
def test_cli_refuses_an_empty_release_even_dry(tmp_path: Path, cli) -> None:
    p = write(tmp_path, "model: {source: m}\noutput: rel\noutputs: []\n")
    for extra in ([], ["--dry-run"]):
        proc = cli("run", p, *extra, cwd=tmp_path)
        assert proc.returncode == 2 and "outputs (line 3): no outputs" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "rel").exists()


def test_duplicate_output_names_refused(tmp_path: Path) -> None:
    text = "model: {source: m}\noutput: rel\noutputs:\n  - method: rtn\n  - method: rtn\n"
    assert "outputs.1 (line 5): writes the same folder 'rtn-w4g128' as outputs.0" in error_of(tmp_path, text)


RELEASE = "model: {source: m}\noutput: rel\noutputs:\n  - method: rtn\n    name: %s\n  - method: gguf\n"


@pytest.mark.parametrize("name", ["../../../../../../tmp/qa2/pwned", "/tmp/qa2/abs", '"."', '".."', "a/b", "a/",
                                  "./a", '"a\\\\b"', ".hidden", '""', '"a\\0b"', "x" * 256])
def test_an_output_name_is_one_plain_folder_of_the_release(tmp_path: Path, name: str) -> None:
    """An artifact written anywhere but its own folder of the release would escape it (and its SHA256SUMS)."""
    msg = error_of(tmp_path, RELEASE % name)
    assert msg.startswith(f"{tmp_path / 'r.yaml'}: outputs.0.name (line 5): ") and "\n" not in msg, msg


def test_an_output_name_is_none_the_release_itself_uses(tmp_path: Path) -> None:
    """The bundle's files, the smoke logs' folder and the manifest name are the release's own, in any case."""
    assert {"SHA256SUMS", "report.md", "report.json", "size-vs-ppl.png", "tasks.md", "logs",
            "quantkit.json"} <= set(RELEASE_NAMES)
    for name in [*RELEASE_NAMES, "Logs", "sha256sums"]:
        msg = error_of(tmp_path, RELEASE % name)
        assert "outputs.0.name (line 5): the release itself uses" in msg, msg


def test_two_outputs_never_share_a_folder_by_spelling(tmp_path: Path) -> None:
    text = RELEASE % "a" + "  - method: rtn\n    bits: 8\n    name: A\n"
    assert "outputs.2.name (line 9): writes the same folder 'A' as outputs.0" in error_of(tmp_path, text)
    assert "outputs.2.name (line 9): './a' is a path" in error_of(tmp_path, text.replace("name: A", "name: ./a"))


def test_a_plain_output_name_is_its_folder(tmp_path: Path) -> None:
    r = recipe.load(write(tmp_path, RELEASE % "rtn_v1.2-final"), check_output_escape=False)
    assert [str(out) for _, out in r.artifacts()] == ["rel/rtn_v1.2-final", "rel/gguf"]


@pytest.mark.cli
def test_cli_refuses_an_output_name_outside_the_release(tmp_path: Path, cli) -> None:
    p = write(tmp_path, RELEASE % "../../../../../../tmp/qa2/pwned")
    proc = cli("run", p, "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "outputs.0.name (line 5): '../../../../../../tmp/qa2/pwned' is a path" in proc.stderr


GATED = "model: {source: m}\noutput: o\nquantize: {method: rtn}\nevaluation:\n  gates: %s\n"


@pytest.mark.parametrize("gates,limits", [
    ("{}", (1.5, 0.5, 0.6)),
    ("{max_kld: 0.01}", (1.5, 0.01, 0.6)),
    ("{max_ppl_ratio: 1.1, min_top1: null}", (1.1, 0.5, None)),
])
def test_a_gate_left_out_keeps_its_default_and_null_turns_it_off(tmp_path: Path, gates: str, limits: tuple) -> None:
    """As with eval's flags: writing one gate keeps the others; only null turns one off."""
    from quantkit.evaluation import gates as gates_mod

    g = recipe.load(write(tmp_path, GATED % gates), check_output_escape=False).evaluation.gates
    assert (g.max_ppl_ratio, g.max_kld, g.min_top1) == limits
    assert len(gates_mod.check({"ppl_ratio": 1.0, "kld": 0.0, "top1": 1.0}, g)) == sum(x is not None for x in limits)


def test_recipe_gates_mean_what_the_same_eval_flags_mean(tmp_path: Path) -> None:
    from quantkit.evaluation import gates as gates_mod

    g = recipe.load(write(tmp_path, GATED % "{max_kld: 0.1}"), check_output_escape=False).evaluation.gates
    assert g == gates_mod.resolve({"max_ppl_ratio": None, "max_kld": 0.1, "min_top1": None})  # eval --max-kld 0.1


def test_a_gate_turned_off_stays_off_in_the_recipe_shown(tmp_path: Path) -> None:
    r = recipe.load(write(tmp_path, GATED % "{max_kld: null}"), check_output_escape=False)
    shown = recipe.dump(r)
    assert "max_kld: null" in shown and "revision" not in shown  # a None that means "unset" is still left out
    again = recipe.load(write(tmp_path, shown), check_output_escape=False)
    assert again.evaluation.gates == r.evaluation.gates and again.sha256() == r.sha256()


NUMBERS = ("model: {source: m}\noutput: o\nquantize: {method: rtn, bits: 4}\n"
           "evaluation:\n  ctx: 512\n  gates: {max_kld: 0.1}\n")


@pytest.mark.parametrize("old,new,where,got", [
    ("max_kld: 0.1", "max_kld: true", "evaluation.gates.max_kld (line 6): expected a valid number", "True"),
    ("max_kld: 0.1", "min_top1: False", "evaluation.gates.min_top1 (line 6): expected a valid number", "False"),
    ("max_kld: 0.1", "max_kld: '0.1'", "evaluation.gates.max_kld (line 6): expected a valid number", "'0.1'"),
    ("ctx: 512", "ctx: '512'", "evaluation.ctx (line 5): expected a valid integer", "'512'"),
    ("ctx: 512", "ctx: 512.0", "evaluation.ctx (line 5): expected a valid integer", "512.0"),
    ("ctx: 512", "enabled: 1", "evaluation.enabled (line 5): expected a valid boolean", "1"),
    ("bits: 4", "bits: '8'", "quantize.bits (line 3): expected 4 or 8", "'8'"),
])
def test_values_are_taken_as_written(tmp_path: Path, old: str, new: str, where: str, got: str) -> None:
    """A string, or a boolean, where a number is expected is refused, never read as one (true was 1.0)."""
    assert f"{where}; got {got}" in error_of(tmp_path, NUMBERS.replace(old, new))


def test_an_integer_serves_as_a_float_and_an_exponent_is_a_number(tmp_path: Path) -> None:
    text = NUMBERS.replace("max_kld: 0.1", "max_kld: 1, min_top1: 5e-1").replace("ctx: 512", "ctx: 512\n  stride: 256")
    r = recipe.load(write(tmp_path, text), check_output_escape=False)
    assert (r.evaluation.gates.max_kld, r.evaluation.gates.min_top1, r.evaluation.stride) == (1.0, 0.5, 256)
    assert "not a finite number" in error_of(tmp_path, NUMBERS.replace("max_kld: 0.1", "max_kld: 1e999"))


def test_a_value_out_of_bounds_hides_none_of_the_other_problems(tmp_path: Path) -> None:
    """A non-finite number (or an overlong string) is refused before the schema looks, and the schema still checks
    the rest: one run lists every problem (docs/recipes.md), and the value set aside adds no second line."""
    text = NUMBERS.replace("max_kld: 0.1", "max_kld: .inf").replace("bits: 4", "bits: 5").replace("ctx: 512",
                                                                                                "ctx: 512\n  bogus: 1")
    err = error_of(tmp_path, text)
    assert "evaluation.gates.max_kld (line 7): inf is not a finite number" in err
    assert "quantize.bits (line 3): expected 4 or 8; got 5" in err and "evaluation.bogus (line 6): unknown key" in err
    assert len(err.splitlines()) == 4, err  # the head line and the three problems
    one = error_of(tmp_path, NUMBERS.replace("method: rtn", "method: .nan"))
    assert one.splitlines()[0].endswith("quantize.method (line 3): nan is not a finite number") and "tag" not in one
    again = recipe.load(write(tmp_path, NUMBERS), check_output_escape=False)  # the mapping the check copied is intact
    assert again.evaluation.gates.max_kld == 0.1


def test_every_flag_reaches_its_field_as_typer_parses_it() -> None:
    """Flags come through the overrides as Typer typed them (int, float, str, bool, list of str): each is of the
    type its field takes, so strict validation refuses none of them for its type."""
    from quantkit import formats

    typed = {int: 8, float: 5.5, str: "auto", bool: True, list: ["x"]}
    for row in formats.verbs():
        for flag in row.flags:
            try:
                recipe.load(None, {f"{flag.field}|{flag.flag}": typed[flag.type], "model.source|MODEL": "m",
                                   "output|OUTPUT": "o"}, base={"quantize": {"method": row.method}})
            except RecipeError as e:
                assert "expected a valid" not in str(e), (row.verb, flag.flag, str(e))


@pytest.mark.cli
def test_cli_numeric_flags_still_plan(cli, tmp_path: Path) -> None:
    proc = cli("gptq", "models/quantkit-tiny", tmp_path / "o", "--bits", "4", "--group-size", "64", "--samples", "8",
               "--seq-len", "64", "--seed", "3", "--target-bits", "5", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_key_set_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two keys without a word: which one was meant is not quantkit's to guess."""
    msg = error_of(tmp_path, GOOD.replace("  bits: 4\n", "  bits: 4\n  bits: 8\n") + "  samples: 8\n")
    assert msg.startswith(f"{tmp_path / 'r.yaml'}: invalid recipe\n"), msg
    assert "quantize.bits (lines 6 and 7): set twice; keep one" in msg
    assert "calibration.samples (lines 11 and 12): set twice; keep one" in msg
    flow = error_of(tmp_path, GOOD.replace("  samples: 16", "  samples: 16\nsmoke: {tp: 1, tp: 2}"))
    assert flow.endswith("smoke.tp (line 11): set twice; keep one"), flow
    merged = GOOD.replace("  method: awq\n  bits: 4\n", "  <<: {method: awq, bits: 4}\n  bits: 8\n")
    assert recipe.load(write(tmp_path, merged), check_output_escape=False).quantize.bits == 8  # a merge key is no twice


@pytest.mark.cli
def test_cli_refuses_a_key_set_twice(tmp_path: Path, cli) -> None:
    p = write(tmp_path, GOOD.replace("  bits: 4\n", "  bits: 4\n  bits: 8\n"))
    proc = cli("awq", "--recipe", p, "--dry-run")
    assert proc.returncode == 2 and "quantize.bits (lines 6 and 7): set twice" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_shipped_recipe_validates() -> None:
    shipped = sorted(recipe.shipped_dir().glob("*.yaml"))
    assert shipped, "recipes/ is empty"
    for p in shipped:
        r = recipe.load(p, check_output_escape=False)
        assert r.artifacts(), p


@pytest.mark.cli
def test_a_shipped_recipe_finds_its_model_from_any_folder(tmp_path: Path, cli) -> None:
    """``quantkit run awq`` from a folder other than the checkout read the shipped recipe's ``models/quantkit-tiny``
    as a hub id and failed as a download: a shipped recipe's source is read from the checkout, its output stays
    under the working folder, and a user's own recipe keeps its paths as written."""
    import json

    proc = cli("run", "awq", "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert Path(plan["source"]["path"]) == recipe.shipped_dir().parent.resolve() / "models" / "quantkit-tiny"
    assert [(tmp_path / o["path"]).resolve() for o in plan["outputs"]] == [tmp_path.resolve() / "out" / "awq"]
    own = write(tmp_path, GOOD)
    assert recipe.load(own, check_output_escape=False).model.source == "models/quantkit-tiny"


@pytest.mark.cli
def test_an_evaluation_field_with_nothing_to_choose_is_refused_before_anything_is_made(tmp_path: Path, cli) -> None:
    """``evaluation.field`` (eval's --field) chooses a record's text field; given for a text without fields (here
    the shipped heldout set, or auto), ``run`` and its dry run refuse it before the first output is made, not once
    it is built and evaluated."""
    from conftest import TINY

    p = write(tmp_path, f"model:\n  source: {TINY}\noutput: out\nquantize:\n  method: rtn\n"
                        "evaluation:\n  dataset: heldout\n  field: body\n")
    for extra in (["--dry-run"], []):
        proc = cli("run", p, *extra, cwd=tmp_path)
        assert proc.returncode == 2 and "text field 'body' given for the shipped set 'heldout'" in proc.stderr, \
            proc.stderr
        assert "eval's --field, or the recipe's evaluation.field" in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "out").exists()
    proc = cli("eval", TINY, "--baseline", TINY, "--field", "body", "--report-dir", tmp_path / "r")
    assert proc.returncode == 2 and "text field 'body' given for the evaluation text auto" in proc.stderr, proc.stderr


@pytest.mark.cli
def test_cli_refuses_bad_recipe_before_loading_a_model(tmp_path: Path, cli) -> None:
    p = write(tmp_path, GOOD.replace("source: models/quantkit-tiny", "source: /does/not/exist")
              .replace("bits: 4", "bits: 5"))
    proc = cli("awq", "--recipe", p, "--samples", "4")
    assert proc.returncode == 2
    assert "quantize.bits (line 6)" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.cli
def test_recipes_command_lists_and_shows(cli) -> None:
    proc = cli("recipes", "--json", check=True)
    import json

    listed = json.loads(proc.stdout)
    shipped = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    assert [Path(r["path"]) for r in listed] == shipped  # every recipe recipes/ holds, nothing else, by name
    assert [r["name"] for r in listed] == [p.stem for p in shipped] and all(r["description"] for r in listed)
    shown = cli("recipes", "awq", check=True)
    assert "recipes/awq.yaml (valid; defaults filled in)" in shown.stdout
    assert "method: awq" in shown.stdout and "samples: 16" in shown.stdout  # the file's own values
    assert "trust_remote_code: false" in shown.stdout and "evaluation:" in shown.stdout  # and defaults it leaves out


def test_the_evaluation_block_under_its_earlier_name_is_read_with_a_note(tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    """``verify:`` was the evaluation block's name: such a recipe still runs as written, and says what to rename;
    one with both names is refused, naming both lines."""
    old = tmp_path / "old.yaml"
    old.write_text("model: {source: m}\noutput: o\nquantize: {method: rtn}\nverify:\n  ctx: 512\n")
    r = recipe.load(old, check_output_escape=False)
    assert r.evaluation.ctx == 512
    assert "'verify:' is now called 'evaluation:'" in capfd.readouterr().err
    both = tmp_path / "both.yaml"
    both.write_text("model: {source: m}\noutput: o\nquantize: {method: rtn}\nevaluation: {ctx: 256}\n"
                    "verify:\n  ctx: 512\n")
    with pytest.raises(recipe.RecipeError, match=r"both 'evaluation:' \(line 4\) and 'verify:' \(line 5"):
        recipe.load(both, check_output_escape=False)
    with pytest.raises(recipe.RecipeError, match=r"evaluation\.ctx \(line 5\)"):
        bad = tmp_path / "bad.yaml"
        bad.write_text("model: {source: m}\noutput: o\nquantize: {method: rtn}\nverify:\n  ctx: 1\n")
        recipe.load(bad, check_output_escape=False)
