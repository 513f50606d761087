"""The SGLang engine's parts that need no GPU: the server command it builds, the load table read from SGLang 0.5.17's
source refusing what that version cannot load (on quantkit's own artifacts of the reference model), the parsing of a
``/generate`` answer shaped exactly as SGLang 0.5.17 builds it, and ``--engine sglang`` refused in one line where
SGLang is not installed. Serving and scoring for real are the H200's (bench/results/h200/sglang/)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, quantkit
from quantkit import recipe
from quantkit.engines import doctor, registry
from quantkit.engines.logits import EngineOptions, Window, log_softmax, open_engine
from quantkit.engines.serving import ServeOptions
from quantkit.engines.sglang import loads, logits
from quantkit.engines.sglang.server import SERVER
from quantkit.errors import BackendError, MissingEngineError, UsageError
from quantkit.formats.names import SGLANG

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def artifacts(tiny_rtn: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """quantkit's own W4A16 (rtn: the session's, read only) and W4A8 (w4a8 --weights rtn) artifacts of the reference
    model."""
    root = tmp_path_factory.mktemp("sglang")
    quantkit("w4a8", TINY, root / "w4a8", "--weights", "rtn", "--quiet", check=True)
    return {"rtn": tiny_rtn, "w4a8": root / "w4a8"}


def config_folder(tmp: Path, name: str, config: dict, hf_quant: dict | None = None) -> Path:
    folder = tmp / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return folder


def preset_config(preset: str, fmt: str, **extra: object) -> dict:
    """A config.json holding compressed-tensors' own serialization of one of its preset schemes."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                            quant_method="compressed-tensors", format=fmt)
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "quantization_config": qc.model_dump(mode="json", exclude_none=True), **extra}


# ------------------------------------------------------------------------------------------------------------------
# The server command


def test_command_names_sglangs_own_flags(tmp_path: Path) -> None:
    art = config_folder(tmp_path, "m", {"max_position_embeddings": 8192})
    argv = SERVER.argv(art, "/env/bin/python", "127.0.0.1", 30123,
                       ServeOptions(tp=2, gpu_memory_utilization=0.3, extra_args=["--attention-backend", "triton"]))
    assert argv[:5] == ["/env/bin/python", "-m", "sglang.launch_server", "--model-path", str(art)]
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "30123", "--context-length": "4096",
                     "--mem-fraction-static": "0.3", "--tp-size": "2", "--random-seed": "0",
                     "--cuda-graph-backend-decode": "disabled", "--cuda-graph-backend-prefill": "disabled",
                     "--sampling-backend": "pytorch", "--grammar-backend": "none", "--watchdog-timeout": "1800",
                     "--attention-backend": "triton"}
    short = config_folder(tmp_path, "short", {"max_position_embeddings": 1024})
    assert "1024" in SERVER.argv(short, "py", "127.0.0.1", 1, ServeOptions())
    assert SERVER.health_path == "/health" and SERVER.speed_extra(64) == {"min_tokens": 64, "ignore_eos": True}


def test_log_facts_read_what_sglang_logs() -> None:
    # The lines as SGLang 0.5.17 formats them: entrypoints/engine.py logger.info(f"{server_args=}"),
    # model_executor/model_runner.py "Load weight end. ...", awq/awq.py's fallback warning.
    log = ("[2026-12-02 10:00:00] server_args=ServerArgs(model_path='/a', quantization=None, "
           "attention_backend='triton', sampling_backend='pytorch')\n"
           "[2026-12-02 10:00:09] Load weight end. elapsed=1.02 s, type=LlamaForCausalLM, quant=awq_marlin, "
           "avail mem=120.31 GB, mem usage=0.09 GB.\n"
           "[2026-12-02 10:00:09] Layer 'model.layers.0.self_attn.qkv_proj' is not supported by AWQMarlin. "
           "Falling back to unoptimized AWQ kernels.\n")
    facts = SERVER.log_facts(log)
    assert facts["model_class"] == "LlamaForCausalLM" and facts["quantization"] == "awq_marlin"
    assert facts["weights_gib"] == 0.09 and facts["attention_backend"] == "triton"
    assert facts["schemes"] == ["is not supported by AWQMarlin. Falling back to unoptimized AWQ kernels"]
    assert "error" not in facts
    crash = SERVER.log_facts(log + "Traceback (most recent call last):\nValueError: 'qwen3_asr' is already used\n")
    assert crash["error"] == "ValueError: 'qwen3_asr' is already used"
    # the fourth H200 run's AutoAWQ server: its warm-up forward (the Marlin JIT build) ran past the watchdog
    hung = SERVER.log_facts(log + "[2026-12-03 07:39:05] Scheduler watchdog timeout (self.watchdog_timeout=300, "
                                  "self.soft=False)\n[2026-12-03 07:39:10] SIGQUIT received.\n")
    assert hung["error"] == ("SGLang's scheduler watchdog stopped a forward pass that ran past 300 s "
                             "(--watchdog-timeout)")


# ------------------------------------------------------------------------------------------------------------------
# The load table and doctor


def test_the_table_loads_quantkits_w4a16_and_refuses_its_w4a8(artifacts: dict[str, Path]) -> None:
    ok = loads.findings(artifacts["rtn"])
    assert [f.status for f in ok] == ["ok"] and "CompressedTensorsWNA16 in the dense layers" in ok[0].message
    assert loads.refusal(artifacts["rtn"]) is None
    why = loads.refusal(artifacts["w4a8"])
    assert why is not None and "No compressed-tensors compatible scheme was found." in why
    assert "int4 group weights, float8 token dynamic activations, format pack-quantized" in why


def test_the_table_follows_sglangs_branches(tmp_path: Path) -> None:
    def status(name: str, config: dict, hf_quant: dict | None = None) -> list[str]:
        return [f.status for f in loads.findings(config_folder(tmp_path, name, config, hf_quant))]

    assert status("fp8", preset_config("FP8", "float-quantized")) == ["ok"]
    # SmolLM2-135M's shapes (576 wide, 9 heads, 3 KV heads): SGLang fuses q/k/v into 576->960, and no tile of its
    # Marlin kernel divides that or o_proj's 576->576; gate_up (576->3072) and down (1536->576) fit one.
    smollm2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    w4 = loads.findings(config_folder(tmp_path, "w4-576", preset_config("W4A16", "pack-quantized", **smollm2)))
    assert [(f.name, f.status) for f in w4] == [("sglang scheme", "ok"), ("sglang marlin", "fail")]
    assert "qkv_proj 576->960, o_proj 576->576: its first forward stops with \"Invalid thread config\"" in w4[1].message
    legacy = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}
    assert status("gptq-576", {**smollm2, "quantization_config": legacy}) == ["ok", "fail"]
    assert status("fp8-576", preset_config("FP8_DYNAMIC", "float-quantized", **smollm2)) == ["ok"]
    assert loads.marlin_misfits(smollm2, tp=3) == ["qkv_proj 576->320", "o_proj 192->576"]
    assert status("fp8-block", preset_config("FP8_BLOCK", "float-quantized")) == ["ok"]
    assert status("int8", preset_config("W8A8", "int-quantized")) == ["ok"]
    # Fused experts: SGLang's W8A8 INT8 MoE scheme exists for NPUs only; FP8 experts load.
    assert status("int8-moe", preset_config("W8A8", "int-quantized", num_local_experts=8)) == ["ok", "fail"]
    assert status("fp8-moe", preset_config("FP8_DYNAMIC", "float-quantized", num_local_experts=8)) == ["ok", "ok"]
    kv = preset_config("FP8_DYNAMIC", "float-quantized")
    kv["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    assert status("kv", kv) == ["ok", "warn"]
    assert status("modelopt-fp8", {}, {"quantization": {"quant_algo": "FP8"}}) == ["ok"]
    # ModelOpt 0.47 writes quant_method "modelopt" into config.json too: SGLang reads that with its FP8 config class.
    modelopt = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}}
    refused = loads.findings(config_folder(tmp_path, "modelopt-w4a8", modelopt,
                                           {"quantization": {"quant_algo": "W4A8_AWQ"}}))
    assert refused[0].status == "fail" and "ModelOptFp8Config only supports static FP8" in refused[0].message
    only = loads.findings(config_folder(tmp_path, "modelopt-int8", {}, {"quantization": {"quant_algo": "INT8_SQ"}}))
    assert only[0].status == "fail" and "load the checkpoint as if it were unquantized" in only[0].message
    assert status("awq8", {"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}}) == ["fail"]
    assert status("plain", {"architectures": ["LlamaForCausalLM"]}) == ["ok"]
    assert loads.refusal(TINY / "tokenizer.json") is not None  # a file: quantkit serves only GGUF files, in llama.cpp


def test_the_table_refuses_every_fp4_artifact_on_hopper(tmp_path: Path) -> None:
    """SGLang 0.5.17 (read from its source) has NVFP4 only with FP4 activations and only on Blackwell; weight-only
    NVFP4 reaches no scheme; MXFP4's float groups fall into the dense WNA16 branch, which serves pack-quantized
    integers only, while MXFP4 experts have their own method. Each refusal quotes SGLang's own error."""
    def why(name: str, preset: str, fmt: str, **extra: object) -> list[tuple[str, str]]:
        found = loads.findings(config_folder(tmp_path, name, preset_config(preset, fmt, **extra)))
        return [(f.status, f.message) for f in found]

    nvfp4 = why("nvfp4", "NVFP4", "nvfp4-pack-quantized")
    assert [s for s, _ in nvfp4] == ["fail"] and "Current platform does not support w4a4 nvfp4" in nvfp4[0][1]
    a16 = why("nvfp4a16", "NVFP4A16", "nvfp4-pack-quantized")
    assert [s for s, _ in a16] == ["fail"] and "No compressed-tensors compatible scheme was found." in a16[0][1]
    for preset in ("MXFP4", "MXFP4A16"):
        mx = why(preset.lower(), preset, "mxfp4-pack-quantized")
        assert [s for s, _ in mx] == ["fail"] and "CompressedTensorsW4A16Sparse24" in mx[0][1], preset
    moe = why("mxfp4-moe", "MXFP4A16", "mxfp4-pack-quantized", num_local_experts=8)
    assert [s for s, _ in moe] == ["fail", "ok"] and "Mxfp4MoEMethod in the experts" in moe[1][1]
    nv_moe = why("nvfp4-moe", "NVFP4", "nvfp4-pack-quantized", num_local_experts=8)
    assert [s for s, _ in nv_moe] == ["fail", "fail"] and "Please use Blackwell" in nv_moe[1][1]


def test_doctor_refuses_what_sglang_cannot_load_and_reports_its_pins(artifacts: dict[str, Path]) -> None:
    report = doctor.check(artifacts["w4a8"], SGLANG, include_quantkit=False)
    failed = {c.name: c.message for c in report.failures()}
    assert "No compressed-tensors compatible scheme was found." in failed["sglang scheme"]
    assert "sglang (sglang) is not installed" in failed["engine installed"]
    # SGLang's own pins against an environment: transformers 5.17 defines qwen3_asr, which SGLang registers itself.
    found = loads.env_findings(["torch==2.11.0", "transformers==5.12.1", "flashinfer_python[cu13]==0.6.15.post1",
                                "av==16.1.0; sys_platform == 'darwin'", "ray>=2.55; extra == 'ray'", "uvloop"],
                               {"torch": "2.11.0+cu130", "transformers": "5.17.0", "flashinfer-python": "0.6.15.post1",
                                "av": "15.0"}, {loads.CONFLICTING_MODULE: True}, "0.5.17")
    assert [(f.name, f.status) for f in found] == [("sglang pins", "warn"), ("sglang transformers", "fail")]
    assert found[0].message == "SGLang pins other versions of: transformers 5.17.0 (pins 5.12.1)"
    assert "'qwen3_asr' is already used by a Transformers config" in found[1].message


def test_smoke_refuses_before_any_server_starts(artifacts: dict[str, Path], tmp_path: Path) -> None:
    proc = quantkit("smoke", artifacts["w4a8"], "--engine", "sglang", "--log-dir", tmp_path, "--json",
                    env={"QUANTKIT_SGLANG_PYTHON": ""})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "refused" and run["engine"] == SGLANG
    assert "is not installed" in run["error"] and "No compressed-tensors compatible scheme was found." in run["error"]
    assert not list(tmp_path.iterdir())  # no server log: nothing was started


# ------------------------------------------------------------------------------------------------------------------
# /generate's answer, as SGLang 0.5.17 builds it


def sglang_generate_result(tokens: list[int], logits_rows: np.ndarray, start: int, k: int, vocab: int) -> dict:
    """One ``/generate`` result for a prompt, built step by step as SGLang 0.5.17 does (paths under sglang/srt/).

    ``logits_rows[p]`` is the model's output at position p, the distribution of token p + 1."""
    logprobs = log_softmax(logits_rows)  # layers/logprob_processor.py _forward_by_chunk: log_softmax, no temperature
    n = len(tokens)
    # layers/logits_processor.py: rows start..n-1 score the next input token; the last row's "next" token is the
    # one being sampled (a placeholder there).
    computed = [float(logprobs[p, tokens[p + 1]]) for p in range(start, n - 1)] + [float(logprobs[n - 1, 0])]
    tops = [(np.sort(logprobs[p])[::-1][:k].tolist(), np.argsort(-logprobs[p], kind="stable")[:k].tolist())
            for p in range(start, n)]
    # managers/scheduler_components/logprob_result_processor.py _process_input_token_logprobs:
    # "add None at start, remove last (sampling token)"; the ids are origin_input_ids[logprob_start_len:], with ids
    # at or above vocab_size - 1 clipped to 0.
    val = [None, *computed[:-1]]
    idx = [x if x < vocab - 1 else 0 for x in tokens[start:]]
    # _process_input_top_logprobs: [None], extended by each chunk's rows, then the last (sampling) row popped.
    top_val, top_idx = [None, *[t[0] for t in tops]], [None, *[t[1] for t in tops]]
    top_val.pop()
    top_idx.pop()
    # managers/tokenizer_manager.py detokenize_logprob_tokens / detokenize_top_logprobs_tokens without text:
    # (logprob, token_id, None) tuples, None for a row without values; the HTTP answer is their JSON.
    meta = {"input_token_logprobs": [(v, i, None) for v, i in zip(val, idx)],
            "input_top_logprobs": [None if not v else [(a, b, None) for a, b in zip(v, i)]
                                   for v, i in zip(top_val, top_idx)],
            "output_token_logprobs": [], "id": "r0", "prompt_tokens": n, "completion_tokens": 1}
    return json.loads(json.dumps({"text": "", "output_ids": [7], "meta_info": meta}))


@pytest.mark.parametrize("score_from", [1, 9])
def test_the_answer_becomes_the_windows_rows(score_from: int) -> None:
    rng = np.random.default_rng(score_from)
    vocab, k = 50, 5
    tokens = [int(t) for t in rng.integers(0, vocab, 16)]
    tokens[12] = vocab - 1  # an id SGLang clips to 0 in input_token_logprobs
    rows = rng.normal(size=(len(tokens), vocab)).astype(np.float32)
    window = Window(index=3, tokens=tuple(tokens), score_from=score_from)
    request = logits.generate_request([window], k)
    assert request["logprob_start_len"] == [score_from - 1] and request["input_ids"] == [tokens]
    assert request["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert request["top_logprobs_num"] == [k] and request["return_logprob"] == [True]
    # the benchmark's floor: the same windows and sampling, no log-probabilities asked for
    assert logits.prefill_request([window]) == {"input_ids": [tokens], "sampling_params": request["sampling_params"]}
    got = logits.parse_result(sglang_generate_result(tokens, rows, score_from - 1, k, vocab), window, k)
    expect = log_softmax(rows)[score_from - 1:len(tokens) - 1]  # row i: the distribution of token score_from + i
    assert np.allclose(got.target, expect[np.arange(window.n_scored), window.targets], atol=1e-6)
    assert (got.ids == np.argsort(-expect, axis=1)[:, :k]).all()
    assert np.allclose(got.values, -np.sort(-expect, axis=1)[:, :k], atol=1e-6)


def test_an_answer_that_does_not_fit_the_window_is_refused() -> None:
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 40, 12)]
    rows = rng.normal(size=(12, 40)).astype(np.float32)
    window = Window(index=0, tokens=tuple(tokens), score_from=4)
    with pytest.raises(BackendError, match="entries from position 3; 9 expected"):  # scored from 0 instead of 3
        logits.parse_result(sglang_generate_result(tokens, rows, 0, 4, 40), window, 4)
    other = Window(index=0, tokens=tuple(t + 1 for t in tokens), score_from=4)  # not the tokens that were sent
    with pytest.raises(BackendError, match="not token"):
        logits.parse_result(sglang_generate_result(tokens, rows, 3, 4, 40), other, 4)
    with pytest.raises(BackendError, match="without input_token_logprobs"):
        logits.parse_result({"meta_info": {"id": "r0"}}, window, 4)


# ------------------------------------------------------------------------------------------------------------------
# Not installed


def test_eval_engine_refused_in_one_line_without_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.get(SGLANG).env_var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `sglang` script to take the interpreter of
    art = config_folder(tmp_path, "fp8", preset_config("FP8_DYNAMIC", "float-quantized"))
    with pytest.raises(MissingEngineError) as e:
        open_engine(SGLANG, art, EngineOptions(ctx=64))
    assert e.value.message == "the SGLang engine needs SGLang, which is not installed in this environment"
    assert "QUANTKIT_SGLANG_PYTHON" in (e.value.hint or "")
    with pytest.raises(UsageError, match="No compressed-tensors compatible scheme"):  # the table refuses first
        open_engine(SGLANG, config_folder(tmp_path, "w4a8", preset_config("W4AFP8", "pack-quantized")),
                    EngineOptions(ctx=64))


@pytest.mark.skipif(SGLANG not in typing.get_args(recipe.EvaluationSpec.model_fields["engine"].annotation),
                    reason="recipe.EvaluationSpec's engine choices do not list sglang yet")
def test_eval_cli_refuses_sglang_in_one_line_when_it_is_not_installed(tmp_path: Path) -> None:
    art = config_folder(tmp_path, "fp8", preset_config("FP8_DYNAMIC", "float-quantized"))
    proc = quantkit("eval", art, "--baseline", TINY, "--engine", "sglang", "--dataset", "heldout", "--max-tokens",
                    "64", "--ctx", "32", env={"QUANTKIT_SGLANG_PYTHON": "", "PATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr  # docs/usage.md: an engine it needs is not installed
    assert "the SGLang engine needs SGLang, which is not installed in this environment" in proc.stderr
    assert "Traceback" not in proc.stderr
