"""The fuzz battery (issue 29): malformed recipes, flag values, checkpoints, GGUF files and manifests.

Two layers. The pure readers (the recipe loader and schema, the safetensors header check, the config check, the
manifest reader) get many generated inputs in-process with hypothesis: each must return a value or raise quantkit's
own error, nothing else. Then sharp cases of each kind go through the real CLI in a subprocess under a memory limit
(``RLIMIT_AS`` 4 GiB) and a time limit: each must end with a documented exit code, print no traceback, and leave
every file outside its output folder as it was (the sandbox hashes the tree before and after).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings, strategies as st

from quantkit import recipe as recipe_mod, source
from quantkit.errors import EXIT_FAILURE, EXIT_GATE, EXIT_OK, EXIT_USAGE, IntegrityError, RecipeError, \
    SourceModelError, UsageError
from quantkit.manifest import MANIFEST, MAX_MANIFEST_BYTES, FileInfo, Manifest, SourceInfo, read_manifest

from conftest import ROOT, TINY
from permissions import without_dac

pytestmark = pytest.mark.unit

MEMORY = 4 << 30
DOCUMENTED = {EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_GATE}
CLI_EXAMPLES = 10  # per property that runs the real CLI (each run is a new process)
# No example database: nothing is written into the checkout (it travels to the GPU machine); a failure prints the
# example hypothesis found, which is what to fix and to add to the sharp cases below.
PROPERTIES: dict[str, int] = {}  # in-process property -> examples it tries (cheap readers get more)


def fast(examples: int):  # noqa: ANN201 - a hypothesis settings decorator that also counts the examples
    def wrap(fn):  # noqa: ANN001, ANN202
        PROPERTIES[fn.__name__] = examples
        return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=[
            HealthCheck.function_scoped_fixture, HealthCheck.too_slow])(fn)
    return wrap


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def limited_quantkit(argv: list[str], cwd: Path, timeout: float = 120,
                     prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The real CLI in a process that cannot take more than :data:`MEMORY` of address space or ``timeout`` s
    (``prefix``: a command it runs under, :func:`without_dac`'s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([*prefix, sys.executable, "-m", "quantkit", *map(str, argv)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=_limits)


def _tree(root: Path, skip: Path | None) -> dict[str, str]:
    found = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        try:
            found[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "d"
        except PermissionError:  # a file a test made unreadable, for a user who is not root: its times stand in
            st = p.stat()
            found[p.relative_to(root).as_posix()] = f"unreadable {st.st_mtime_ns} {st.st_size}"
    return found


class Sandbox:
    """A working folder; :meth:`run` runs the CLI there and checks what every fuzz case must hold."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs = 0
        self.prefix: tuple[str, ...] = ()  # limited_quantkit's

    def run(self, *argv: str, out: str | None = None, expect: set[int] = DOCUMENTED) -> subprocess.CompletedProcess:
        skip = self.root / out if out else None
        before = _tree(self.root, skip)
        proc = limited_quantkit(list(argv), self.root, prefix=self.prefix)
        self.runs += 1
        where = f"quantkit {' '.join(argv)} -> {proc.returncode}\n{proc.stderr[-2000:]}"
        assert proc.returncode in expect, where
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, where
        assert _tree(self.root, skip) == before, where
        return proc


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    shutil.copytree(TINY, tmp_path / "model")
    return Sandbox(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# Values a careless or hostile file holds

huge_ints = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**40, 10**400])
odd_scalars = st.one_of(huge_ints, st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                        st.none(), st.text(max_size=20), st.just("x" * 5000), st.just("2024-13-45"))
json_values = st.recursive(odd_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=20)


# ----------------------------------------------------------------------------------------------------------------
# Recipes, in-process

RECIPE_KEYS = ["model", "output", "quantize", "outputs", "calibration", "evaluation", "smoke", "runtime", "source",
               "method", "samples", "seq_len", "seed", "ctx", "gates", "max_kld", "types", "name", "bits", "tp"]
YAML_BITS = st.sampled_from(["&a ", "*a", "<<: ", "!!int ", "!!float ", "!!binary ", "!!python/object ", "? ", "- ",
                             "[", "]", "{", "}", ", ", ": ", "\n", "\n  ", "\t", "'", '"', "#", "|", ">", "---\n",
                             "...", "%YAML 1.1\n", "~", "1e999", "0x", "0o7", "-.inf", ".nan", "2001-12-14"])


def _load_or_refuse(path: Path) -> None:
    try:
        recipe_mod.load(path, check_output_escape=False)
    except RecipeError as e:
        assert str(path) in e.message, e.message  # the refusal names the recipe file


@fast(300)
@given(st.lists(st.one_of(YAML_BITS, st.sampled_from(RECIPE_KEYS), st.text(max_size=6)), max_size=60))
def test_any_yaml_text_is_a_recipe_or_a_recipe_error(tmp_path: Path, parts: list[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("".join(parts))
    _load_or_refuse(path)


def _recipe_like(values: st.SearchStrategy) -> st.SearchStrategy:
    method = st.sampled_from(["rtn", "gptq", "awq", "gguf", "fp8", "int8", "w4a8", "trt", "nope"])
    spec = st.fixed_dictionaries({"method": method}, optional={k: values for k in (
        "bits", "group_size", "types", "name", "ignore", "samples", "imatrix_file", "scheme", "format")})
    return st.fixed_dictionaries({"model": st.fixed_dictionaries({"source": values}), "output": values},
                                 optional={"quantize": spec, "outputs": st.lists(spec, max_size=3),
                                           "calibration": st.dictionaries(st.sampled_from(
                                               ["dataset", "samples", "seq_len", "seed", "field"]), values),
                                           "evaluation": st.dictionaries(st.sampled_from(
                                               ["ctx", "stride", "max_tokens", "gates", "dataset"]), values),
                                           "runtime": st.dictionaries(st.sampled_from(
                                               ["seed", "num_gpus", "device", "python"]), values)})


@fast(100)
@given(_recipe_like(json_values))
def test_any_recipe_shaped_document_is_a_recipe_or_a_recipe_error(tmp_path: Path, doc: dict) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    _load_or_refuse(path)


FIELDS = ["calibration.samples", "calibration.seq_len", "calibration.seed", "runtime.seed", "runtime.num_gpus",
          "evaluation.ctx", "evaluation.max_tokens", "evaluation.gates.max_kld", "smoke.timeout", "smoke.tp", "output",
          "model.source", "quantize.bits", "quantize.group_size", "quantize.ignore"]


@fast(300)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, min_size=1, max_size=4))
@example({"calibration.samples": {"\n": 10**40}})  # found in CI: a key's newline once broke the one-line message
def test_any_flag_values_are_a_recipe_or_a_recipe_error(flags: dict) -> None:
    base = {"model": {"source": "m"}, "output": "o", "quantize": {"method": "rtn"}}
    try:
        recipe_mod.load(None, {f"{k}|--{k.rsplit('.', 1)[-1]}": v for k, v in flags.items()}, base)
    except RecipeError as e:
        assert "\n" not in e.message or e.message.startswith("command line: invalid recipe")


@pytest.mark.parametrize("depth", [33, 2000])
def test_deep_nesting_and_many_aliases_are_bounded(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("a: " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(RecipeError, match="line 1 is refused: nested more than 32 levels deep"):
        recipe_mod.load(path)
    path.write_text("a: &a 1\nb: [" + ", ".join(["*a"] * 65) + "]\n")
    with pytest.raises(RecipeError, match=r"line 2 is refused: more than 64 aliases"):
        recipe_mod.load(path)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints, in-process

DTYPES = st.sampled_from(["F32", "BF16", "F16", "I8", "U8", "F8_E4M3", "BOOL", "XX", "", 7, None, ["F32"]])
shapes = st.one_of(st.lists(st.integers(-2, 6), max_size=3), st.lists(huge_ints, max_size=2), odd_scalars,
                   st.lists(odd_scalars, max_size=2))
offsets = st.one_of(st.lists(st.integers(-4, 300), min_size=2, max_size=2), st.lists(huge_ints, max_size=3),
                    odd_scalars)
entries = st.one_of(st.fixed_dictionaries({"dtype": DTYPES, "shape": shapes, "data_offsets": offsets}), json_values)


def _write_safetensors(path: Path, header: object, data: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _check(path: Path) -> int | None:
    try:
        return source.check_safetensors(path)
    except SourceModelError:
        return None


@fast(300)
@given(st.dictionaries(st.text(max_size=6), entries, max_size=5), st.integers(0, 300))
def test_any_safetensors_header_is_vetted_or_refused(tmp_path: Path, header: dict, data_len: int) -> None:
    path = tmp_path / "m.safetensors"
    _write_safetensors(path, header, b"\0" * data_len)
    if _check(path) is None:
        return
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert all(0 <= a <= b <= data_len for a, b in spans)  # what it accepts lies inside the file
    assert all(b1 <= a2 or a2 == b2 for (_, b1), (a2, b2) in zip(spans, spans[1:]))  # and shares no bytes


@fast(300)
@given(st.binary(max_size=64), st.one_of(st.integers(0, 80), huge_ints.filter(lambda n: 0 <= n < 2**64)))
def test_any_bytes_or_header_length_are_vetted_or_refused(tmp_path: Path, body: bytes, length: int) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", length) + body)
    _check(path)


def test_overlapping_and_out_of_file_tensors_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    t = {"dtype": "F32", "shape": [2]}
    for header, why in (({"a": {**t, "data_offsets": [0, 8]}, "b": {**t, "data_offsets": [4, 12]}}, "overlap"),
                        ({"a": {**t, "data_offsets": [0, 8]}, "b": {**t, "data_offsets": [8, 16]}}, "truncated"),
                        ({"a": {**t, "data_offsets": ["0", 8]}}, "bad header entry"),
                        ({"a": {**t, "shape": [-2, -1], "data_offsets": [0, 8]}}, "bad header entry"),
                        ({"a": {**t, "shape": [3], "data_offsets": [0, 8]}}, "expected 12")):
        _write_safetensors(path, header, b"\0" * 12)
        with pytest.raises(SourceModelError, match=why):
            source.check_safetensors(path)


SIZE_KEYS = list(source.SIZE_FIELDS) + ["text_config", "auto_map"]


@fast(100)
@given(st.dictionaries(st.sampled_from(SIZE_KEYS), json_values, max_size=5))
def test_any_config_sizes_are_vetted_or_refused(tmp_path: Path, changes: dict) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    config = {**json.loads((TINY / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(TINY / "tokenizer.json", folder / "tokenizer.json")  # vet checks the tokenizer too
    _write_safetensors(folder / "model.safetensors", {"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}},
                       b"\0" * 8)
    try:
        model = source.vet(folder, trust_remote_code=True)
    except SourceModelError:
        return
    from quantkit import plan
    from quantkit.recipe import Recipe

    r = Recipe.model_validate({"model": {"source": str(folder)}, "output": "o", "quantize": {"method": "gptq"}})
    host, gpu = plan.memory(r, r.quantize, model)
    assert host >= 0 and gpu >= 0


# ----------------------------------------------------------------------------------------------------------------
# Manifests, in-process

MANIFEST_FIELDS = ["schema_version", "schema", "kind", "format", "method", "source", "files", "calibration", "evaluation",
                   "params", "timings", "notes", "created"]


def _real_manifest() -> dict:
    return Manifest(kind="test", method="rtn", source=SourceInfo(
        id="m", path="/m", config_sha256="0" * 64), files={"a": FileInfo(sha256="0" * 64, size=1)}).to_json()


@fast(200)
@given(st.one_of(json_values, st.dictionaries(st.sampled_from(MANIFEST_FIELDS), json_values, max_size=4).map(
    lambda changes: {**_real_manifest(), **changes})))
def test_any_manifest_is_read_or_refused(tmp_path: Path, data: object) -> None:
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    try:
        m = read_manifest(tmp_path)
    except (IntegrityError, UsageError):
        return
    assert m.size_bytes >= 0


def test_a_manifest_nested_too_deeply_or_too_large_is_refused(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(IntegrityError, match="nested too deeply"):
        read_manifest(tmp_path)
    with open(tmp_path / MANIFEST, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk taken
    with pytest.raises(IntegrityError, match="larger than"):
        read_manifest(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# The real CLI, under limits

SHARP_RECIPES = {
    "deep.yaml": "model:\n  source: model\noutput: " + "[" * 500 + "]" * 500 + "\n",
    "aliases.yaml": "x: &x [a, b]\n" + "".join(f"k{i}: *x\n" for i in range(100)),
    "merge.yaml": "a: &a {k: 1}\n" + "".join(f"m{i}: &m{i} {{<<: [*{'a' if i == 0 else f'm{i - 1}'}]}}\n"
                                             for i in range(70)),
    "number.yaml": "model:\n  source: model\noutput: out\nquantize:\n  method: rtn\nruntime:\n  seed: " + "9" * 5000,
    "string.yaml": "model:\n  source: model\noutput: out\nquantize:\n  method: rtn\n  name: " + "n" * 100_000,
    "date.yaml": "model:\n  source: model\noutput: out\nquantize:\n  method: rtn\nruntime:\n  seed: 2024-13-45\n",
    "tagged.yaml": "model: !!python/object/apply:os.system ['touch pwned']\noutput: out\n",
    "wrongtag.yaml": "model:\n  source: model\noutput: out\nquantize:\n  method: rtn\n  bits: !!int four\n",
    "inf.yaml": "model:\n  source: model\noutput: out\nquantize:\n  method: rtn\nsmoke:\n  timeout: .inf\n",
    "two.yaml": "model: {source: model}\n---\noutput: out\n",
    "key.yaml": "? [a, b]\n: c\n",
    "binary.yaml": "model:\n  source: \0\x01\x02\noutput: out\n",
}


@pytest.mark.slow  # dozens of real processes: the e2e tier's (docs/testing.md)
def test_sharp_recipes_through_the_cli(sandbox: Sandbox) -> None:
    for name, text in SHARP_RECIPES.items():
        (sandbox.root / name).write_text(text)
    (sandbox.root / "huge.yaml").write_bytes(b"# " + b"x" * (recipe_mod.MAX_RECIPE_BYTES + 10))
    (sandbox.root / "latin1.yaml").write_bytes("model:\n  source: caf\xe9\n".encode("latin-1"))
    for name in [*SHARP_RECIPES, "huge.yaml", "latin1.yaml"]:
        proc = sandbox.run("run", name, "--dry-run", out="out", expect={EXIT_USAGE})
        assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    assert not (sandbox.root / "pwned").exists()


flag_values = st.one_of(huge_ints.map(str), st.integers().map(str), st.sampled_from(
    ["nan", "inf", "-inf", "1e999", "", " ", "0x10", "--", "-1", "1.5", "../model", "model", "\x7f"]),
    st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), max_size=12))
FLAGS = st.sampled_from([("rtn", "--bits"), ("rtn", "--group-size"), ("rtn", "--seed"), ("rtn", "--device"),
                         ("gptq", "--samples"), ("gptq", "--seq-len"), ("gptq", "--calib"), ("gptq", "--num-gpus"),
                         ("gguf", "-t"), ("rtn", "--ignore"), ("rtn", "--dtype")])


@pytest.mark.slow  # dozens of real processes: the e2e tier's (docs/testing.md)
@settings(max_examples=CLI_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(FLAGS, flag_values)
@example(("gptq", "--calib"), str(10**400))  # a 401-byte file name: Path.exists() raised ENAMETOOLONG (a traceback)
def test_flag_values_through_the_cli(sandbox: Sandbox, flag: tuple[str, str], value: str) -> None:
    verb, name = flag
    sandbox.run(verb, "model", "out", f"{name}={value}", "--dry-run", out="out")


@pytest.mark.slow  # a dozen real processes: the e2e tier's (docs/testing.md)
def test_names_too_long_for_the_filesystem_through_the_cli(sandbox: Sandbox) -> None:
    """Every verb that takes a path refuses a name longer than the filesystem allows in one line (exit 2), wherever
    it meets it first, and leaves nothing behind: the real run of an output below a missing folder created that
    folder before failing, and --dry-run passed it."""
    long = "n" * 300
    (sandbox.root / "long-calib.yaml").write_text(
        f"model: {{source: model}}\noutput: out\nquantize: {{method: gptq}}\ncalibration: {{dataset: {long}}}\n")
    cases = [("rtn", long, "out", "--dry-run"), ("rtn", "model", long, "--dry-run"),
             ("rtn", "model", f"out/{long}/x", "--dry-run"), ("rtn", "model", f"out/{long}/x"),
             ("gptq", "model", "out", f"--calib={long}", "--dry-run"), ("run", f"{long}.yaml", "--dry-run"),
             ("run", "long-calib.yaml", "--dry-run"), ("eval", long), ("verify", long), ("inspect", long),
             ("smoke", long), ("calib", "show", long)]
    for argv in cases:
        proc = sandbox.run(*argv, expect={EXIT_USAGE})
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 2 and "name too long for the filesystem" in lines[0] and "is 30" in lines[0], lines
    proc = sandbox.run("verify", long, "--json", expect={EXIT_USAGE})
    assert json.loads(proc.stdout)["exit_code"] == EXIT_USAGE


@pytest.mark.slow  # two dozen real processes: the e2e tier's (docs/testing.md)
def test_paths_this_user_may_not_use_through_the_cli(sandbox: Sandbox) -> None:
    """A path below a folder its user may not search (``Path.exists()`` raises EACCES rather than saying no), a file
    it may not read, a folder it may not write: one line and a hint, exit 2, nothing left behind, in every verb
    that takes a path. Before, a source, an output's folder, a recipe, ``--calib`` or an artifact below such a
    folder ended in a traceback (exit 1)."""
    r = sandbox.root
    recipe = "model: {source: model}\noutput: out\nquantize: {method: rtn}\n"
    locked = r / "locked"
    shutil.copytree(TINY, locked / "art")
    (locked / "c.jsonl").write_text('{"text": "x"}\n')
    (locked / "r.yaml").write_text(recipe)
    (r / "secret.yaml").write_text(recipe)
    (r / "secret.jsonl").write_text('{"text": "x"}\n')
    for name in ("no-config", "no-weights"):
        shutil.copytree(TINY, r / name)
    (r / "ro").mkdir()
    sandbox.prefix = without_dac()
    for path, mode in ((locked, 0), (r / "secret.yaml", 0), (r / "secret.jsonl", 0), (r / "ro", 0o555),
                       (r / "no-config" / "config.json", 0), (r / "no-weights" / "model.safetensors", 0)):
        path.chmod(mode)
    denied = "permission denied: "
    cases = {denied + "locked/art": [("rtn", "locked/art", "out", "--dry-run"), ("eval", "locked/art"),
                                     ("verify", "locked/art"), ("inspect", "locked/art"), ("smoke", "locked/art")],
             denied + "locked/sub": [("rtn", "model", "locked/sub/out", "--dry-run"),
                                     ("rtn", "model", "locked/sub/out")],
             denied + "locked/c.jsonl": [("gptq", "model", "out", "--calib=locked/c.jsonl", "--dry-run"),
                                         ("calib", "show", "locked/c.jsonl")],
             denied + "locked/r.yaml": [("run", "locked/r.yaml", "--dry-run")],
             denied + "no-weights/model.safetensors": [("rtn", "no-weights", "out", "--dry-run"),
                                                       ("rtn", "no-weights", "out")],
             "cannot read secret.jsonl: Permission denied": [
                 ("gptq", "model", "out", "--calib=secret.jsonl", "--dry-run"), ("calib", "show", "secret.jsonl")],
             "cannot read recipe secret.yaml: Permission denied": [("run", "secret.yaml", "--dry-run")],
             "no-config/config.json is not readable": [("rtn", "no-config", "out", "--dry-run")],
             "nothing can be written in ro": [("rtn", "model", "ro/out", "--dry-run"), ("rtn", "model", "ro/out")]}
    try:
        for said, runs in cases.items():
            for argv in runs:
                proc = sandbox.run(*argv, expect={EXIT_USAGE})
                first = proc.stderr.strip().splitlines()[0]
                assert first.startswith("error: ") and said in first, (argv, proc.stderr)
        proc = sandbox.run("verify", "locked/art", "--json", expect={EXIT_USAGE})
        assert json.loads(proc.stdout)["error"] == denied + "locked/art"
    finally:
        locked.chmod(0o755)  # pytest removes its folders as root, but a user who is not root could not


def _checkpoint(root: Path, name: str, config: dict | None = None, header: object = None,
                data: bytes = b"\0" * 8, length: int | None = None) -> str:
    folder = root / name
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, folder / f)
    cfg = {**json.loads((TINY / "config.json").read_text()), **(config or {})}
    (folder / "config.json").write_text(json.dumps(cfg))
    if header is None:
        header = {"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}
    _write_safetensors(folder / "model.safetensors", header, data, length)
    return name


@pytest.mark.slow  # dozens of real processes: the e2e tier's (docs/testing.md)
def test_malformed_checkpoints_through_the_cli(sandbox: Sandbox) -> None:
    r = sandbox.root
    t = {"dtype": "F32", "shape": [2]}
    cases = [
        _checkpoint(r, "header-len", length=2**63),
        _checkpoint(r, "overlap", header={"a": {**t, "data_offsets": [0, 8]}, "b": {**t, "data_offsets": [4, 12]}},
                    data=b"\0" * 12),
        _checkpoint(r, "outside", header={"a": {**t, "data_offsets": [0, 2**62]}}),
        _checkpoint(r, "mismatch", header={"a": {"dtype": "BF16", "shape": [3, 3], "data_offsets": [0, 8]}}),
        _checkpoint(r, "header-list", header=[1, 2]),
        _checkpoint(r, "negative", config={"num_hidden_layers": -4}),
        _checkpoint(r, "per-layer", config={"intermediate_size": [768] * 8}),
        _checkpoint(r, "huge", config={"intermediate_size": 10**30}),
        _checkpoint(r, "text-config", config={"text_config": [1]}),
        _checkpoint(r, "auto-map", config={"auto_map": 5}),
    ]
    (r / "bad-json").mkdir()
    (r / "bad-json" / "config.json").write_text("[" * 100_000)
    (r / "bad-quant").mkdir()
    (r / "bad-quant" / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": [1]}}))
    for name in cases + ["bad-json"]:
        proc = sandbox.run("rtn", name, "out", "--dry-run", out="out", expect={EXIT_USAGE})
        assert name in proc.stderr
    sandbox.run("rtn", _checkpoint(r, "zero", config={"hidden_size": 0, "head_dim": 0}), "out", "--dry-run",
                out="out")  # zero is a size some configs hold (head_dim): planned or refused, never a traceback
    for name in ("bad-json", "bad-quant", "header-list"):
        sandbox.run("inspect", name)


def _gguf(path: Path) -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_name("fuzz")
    w.add_tensor("t", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _gguf_mutants(good: bytes) -> dict[str, bytes]:
    def put(offset: int, fmt: str, value: int) -> bytes:
        return good[:offset] + struct.pack(fmt, value) + good[offset + struct.calcsize(fmt):]

    return {"magic": b"NOPE" + good[4:], "version": put(4, "<I", 999), "tensors": put(8, "<Q", 2**62),
            "kvs": put(16, "<Q", 2**62), "key-length": put(24, "<Q", 2**63), "half": good[: len(good) // 2],
            "head": good[:30], "empty": b""}


@pytest.mark.slow  # dozens of real processes: the e2e tier's (docs/testing.md)
def test_malformed_gguf_and_manifests_through_the_cli(sandbox: Sandbox) -> None:
    r = sandbox.root
    good = _gguf(r / "good.gguf")
    for name, data in _gguf_mutants(good).items():
        (r / f"{name}.gguf").write_bytes(data)
        sandbox.run("inspect", f"{name}.gguf")
    for name, text in {"not-json": "{", "list": "[]", "deep": "[" * 50_000, "schema": '{"schema_version": "2"}',
                       "types": json.dumps({**_real_manifest(), "files": {"a": {"sha256": 5, "size": "big"}}})}.items():
        (r / name).mkdir()
        shutil.copy(r / "tensors.gguf", r / name / "m.gguf")
        (r / name / MANIFEST).write_text(text)
        for verb in ("inspect", "verify"):
            proc = sandbox.run(verb, name, expect={EXIT_FAILURE, EXIT_USAGE})
            assert MANIFEST in proc.stderr
    for name in ("deep", "types"):  # refused before the hub is asked (offline here)
        proc = sandbox.run("publish", name, "--repo", "org/name", expect={EXIT_FAILURE})
        assert MANIFEST in proc.stderr
    sandbox.run("eval", "half.gguf", "--baseline", "model", "--dataset", "heldout", "--max-tokens", "64",
                "--report-dir", "reports", out="reports", expect={EXIT_FAILURE, EXIT_USAGE})
    sandbox.run("eval", "deep", "--baseline", "model", "--max-tokens", "64", "--report-dir", "reports",
                out="reports", expect={EXIT_FAILURE, EXIT_USAGE})


def cases_tried() -> int:
    """How many inputs one run of this battery tries (docs/reliability.md quotes it)."""
    in_process = sum(PROPERTIES.values()) + 2 * 2 + 5 + 2
    cli = (len(SHARP_RECIPES) + 2) + CLI_EXAMPLES + (10 + 1 + 1 + 3) + (8 + 5 * 2 + 2 + 2)
    return in_process + cli


def test_the_count_the_docs_quote_is_this_batterys() -> None:
    page = (ROOT / "docs" / "reliability.md").read_text()
    assert f"{cases_tried():,} cases" in page, cases_tried()
