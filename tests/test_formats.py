"""The formats registry is the one place a format is described, and the layers keep their import rules.

These read the code as it is (rows, modules, imports); what each format produces is tested end to end in the
producer tests.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit import formats
from quantkit.errors import UsageError
from quantkit.formats import kinds
from quantkit.formats.specs import AwqSpec, GptqSpec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "quantkit" / "cli"
# Every quantkit module the CLI may import, matched exactly (a prefix would let quantkit.formats.kinds or
# quantkit.api's neighbours through): the API it calls, the registry its verbs, help and flags are built from, the
# errors it catches and maps to exit codes, the progress reporter it draws, the signal handling each command
# installs, the version it prints, the names its --engine choices are read from, and its own modules; and ``run``'s
# pipeline, which stands above the API's single-artifact functions and calls them. Producers, engines and heavy
# libraries are reached only through those.
CLI_MAY_IMPORT = frozenset({"quantkit.api", "quantkit.pipeline", "quantkit.formats", "quantkit.formats.names",
                            "quantkit.errors",
                            "quantkit.progress", "quantkit.interrupts", "quantkit.__version__", "quantkit.cli"}
                           | {f"quantkit.cli.{p.stem}" for p in CLI.glob("*.py") if p.stem != "__init__"})
HEAVY = ("torch", "transformers", "llmcompressor", "compressed_tensors", "llama_cpp", "gguf", "vllm", "modelopt",
         "numpy", "quantkit.producers.compressed", "quantkit.producers.oneshot", "quantkit.producers.torchrun",
         "quantkit.producers.gguf", "quantkit.producers.trt",
         "quantkit.engines.transformers.logits", "quantkit.engines.llamacpp.logits", "quantkit.engines.vllm.logits")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "quantkit":
                out |= {f"quantkit.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _is_module(name: str) -> bool:
    folder = ROOT.joinpath(*name.split("."))
    return folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file()


def _quantkit_imports(path: Path) -> set[str]:
    """The quantkit modules (or package attributes) a file imports, each by its full name: ``from quantkit import
    api`` names ``quantkit.api`` and not the package, ``from quantkit.formats import kinds`` names the submodule
    ``quantkit.formats.kinds`` too, a relative import is resolved against the file's package; so only ``import
    quantkit`` itself (whose attributes reach everything) names ``quantkit``."""
    package = path.relative_to(ROOT).parent.parts
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else ())
            module = ".".join(p for p in (base, node.module or "") if p)
            if module != "quantkit" and node.module:
                out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names
                    if module == "quantkit" or not node.module or _is_module(f"{module}.{a.name}")}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "quantkit" or m.startswith("quantkit.")}


def test_every_method_has_a_row_a_producer_and_a_kind() -> None:
    for row in formats.FORMATS:
        assert importlib.import_module(row.producer).PRODUCER is not None, row.key
        assert row.kind in kinds.BY_NAME, row.key
    keys = [row.key for row in formats.FORMATS]
    assert len(keys) == len(set(keys))


def test_legacy_layouts_are_their_own_rows() -> None:
    assert formats.for_spec(AwqSpec(method="awq")).producer == "quantkit.producers.compressed"
    assert formats.for_spec(AwqSpec(method="awq", format="autoawq")).producer == "quantkit.producers.legacy"
    assert formats.for_spec(GptqSpec(method="gptq", format="gptq")).key == "gptq+gptq"
    assert [row.key for row in formats.FORMATS if row.llmcompressor] == [
        "awq", "awq+autoawq", "gptq", "gptq+gptq", "autoround", "fp8", "int8", "w4a8", "rtn", "nvfp4", "mxfp4"]


@pytest.mark.cli
def test_each_verb_shows_only_the_flags_its_format_uses(cli) -> None:
    for row in formats.verbs():
        shown = cli(row.verb, "--help", check=True).stdout
        for flag in row.flags:
            assert flag.flag in shown, (row.verb, flag.flag)
        assert "Examples" in shown and row.examples[0] in shown
    rtn = cli("rtn", "--help", check=True).stdout
    assert "--samples" not in rtn and "--calib" not in rtn and "--num-gpus" not in rtn
    gguf = cli("gguf", "--help", check=True).stdout
    assert "--ignore" not in gguf and "--num-gpus" not in gguf and "--dtype" not in gguf


@pytest.mark.cli
def test_a_flag_the_verb_does_not_use_is_refused(cli) -> None:
    proc = cli("rtn", "models/quantkit-tiny", "out/never", "--samples", "8")
    assert proc.returncode == 2 and "No such option" in proc.stderr
    assert not (ROOT / "out" / "never").exists()


def test_kinds_recognise_each_artifact_layout(tmp_path: Path) -> None:
    def folder(name: str, files: dict[str, object]) -> Path:
        p = tmp_path / name
        p.mkdir()
        for f, content in files.items():
            (p / f).write_text(content if isinstance(content, str) else json.dumps(content))
        return p

    cases = {
        "gguf": folder("g", {"m-Q8_0.gguf": ""}),
        "modelopt": folder("mo", {"config.json": {}, "hf_quant_config.json": {}}),
        "trtllm-checkpoint": folder("tc", {"config.json": {"architecture": "Llama", "quantization": {}}}),
        "compressed-tensors": folder("ct", {"config.json": {"quantization_config": {"quant_method":
                                                                                    "compressed-tensors"}}}),
        "awq": folder("awq", {"config.json": {"quantization_config": {"quant_method": "awq"}}}),
        "gptq": folder("gptq", {"config.json": {"quantization_config": {"quant_method": "gptq"}}}),
        "hf": folder("hf", {"config.json": {"architectures": ["LlamaForCausalLM"]}}),
    }
    for name, path in cases.items():
        assert kinds.detect(path).name == name
    assert kinds.detect(cases["gguf"] / "m-Q8_0.gguf").name == "gguf"
    with pytest.raises(UsageError, match="neither .gguf files nor a checkpoint"):
        kinds.detect(folder("empty", {}))


def test_cli_reaches_the_work_only_through_the_api() -> None:
    for path in sorted(CLI.glob("*.py")):
        own = _quantkit_imports(path)
        bad = own - CLI_MAY_IMPORT
        assert not bad, f"{path.name} imports {sorted(bad)}: call quantkit.api instead"


def test_the_cli_imports_nothing_heavy() -> None:
    code = ("import sys, json, quantkit.cli.main\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       cwd=ROOT).stdout)
    assert loaded == []


def test_evaluation_result_types_import_neither_side() -> None:
    package = ROOT / "quantkit" / "evaluation"
    assert not {"quantkit.evaluation.evaluate", "quantkit.evaluation.report"} & _imports(package / "results.py")
    assert "quantkit.evaluation.evaluate" not in _imports(package / "report.py")


@pytest.mark.cli
def test_tune_refuses_clearly_without_vllm_or_for_gguf(cli, tmp_path: Path) -> None:
    """The kernel sweep needs vLLM (on a GPU): without it, one line and exit 1 (docs/usage.md: a backend it needs is
    not installed), before anything starts."""
    ct = tmp_path / "ct"
    ct.mkdir()
    (ct / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    proc = cli("tune", ct, env={"QUANTKIT_VLLM_PYTHON": ""})
    if importlib.util.find_spec("vllm") is None:
        assert proc.returncode == 1 and "needs vLLM" in proc.stderr and "--python" in proc.stderr
    gguf = tmp_path / "g"
    gguf.mkdir()
    (gguf / "m-Q8_0.gguf").write_bytes(b"")
    proc = cli("tune", gguf)
    assert proc.returncode == 2 and "vLLM does not serve" in proc.stderr and "Traceback" not in proc.stderr


def test_every_hint_names_a_flag_that_exists() -> None:
    """A hint that tells a user to pass a flag must name one of quantkit's flags (or the llama.cpp/vLLM/TensorRT-LLM
    tool flag it quotes), so following the hint never ends in "No such option"."""
    import click
    import typer.main

    from quantkit.cli.main import app

    known: set[str] = set()

    def walk(cmd: click.Command) -> None:
        for p in cmd.params:
            known.update(o for o in [*p.opts, *p.secondary_opts] if o.startswith("--"))
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    # --help, and flags of the tools a hint quotes (pip, llama-quantize, llama-imatrix, vllm serve,
    # convert_hf_to_gguf.py)
    foreign = {"--help", "--target", "--imatrix", "--output-format", "--kl-divergence", "--quantization",
               "--enforce-eager", "--linear-backend", "--moe-backend", "--host", "--port", "--print-supported-models"}
    missing: dict[str, set[str]] = {}
    for path in sorted((ROOT / "quantkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "hint":
                text = " ".join(c.value for c in ast.walk(node.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
                    if flag not in known and flag not in foreign:
                        missing.setdefault(flag, set()).add(path.name)
    assert not missing, f"hints name flags no verb has: {missing}"
