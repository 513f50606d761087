"""Calibration loading from every local source type, bounded samples, and the token hash."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from pathlib import Path

import pytest

from quantkit import calibration
from quantkit.errors import CalibrationError, UsageError
from quantkit.recipe import CalibrationSpec

pytestmark = pytest.mark.unit

TEXTS = [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(12)]


@pytest.fixture(scope="module")
def tok(tiny: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def spec(source: str, **kw) -> CalibrationSpec:
    return CalibrationSpec(dataset=source, **{"samples": 4, "seq_len": 64, **kw})


def write_sources(tmp_path: Path) -> dict[str, Path]:
    out = {}
    (tmp_path / "a.txt").write_text("\n\n".join(TEXTS))
    out["txt"] = tmp_path / "a.txt"
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out["jsonl"] = tmp_path / "a.jsonl"
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in TEXTS)
    out["jsonl.gz"] = tmp_path / "a.jsonl.gz"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "a.parquet")
    out["parquet"] = tmp_path / "a.parquet"
    return out


def test_every_local_source_type_gives_the_same_tokens(tmp_path: Path, tok) -> None:
    src = write_sources(tmp_path)
    hashes = {}
    for kind, path in src.items():
        field = "body" if kind == "jsonl.gz" else "text"
        cs = calibration.build(spec(str(path), field=field), tok)
        assert len(cs.samples) == 4 and all(len(s) == 64 for s in cs.samples)
        assert cs.documents.items[0].startswith("Document number 0")
        hashes[kind] = cs.tokens_sha256
    assert len(set(hashes.values())) == 1, hashes  # same documents, same seed -> identical token ids


def test_token_hash_tracks_the_exact_tokens(tok) -> None:
    a = calibration.build(spec("prose"), tok)
    b = calibration.build(spec("prose"), tok)
    c = calibration.build(spec("prose", seed=1), tok)
    d = calibration.build(spec("prose", seq_len=65), tok)
    assert a.tokens_sha256 == b.tokens_sha256
    assert a.samples == b.samples
    assert len({a.tokens_sha256, c.tokens_sha256, d.tokens_sha256}) == 3
    assert a.tokens_sha256 == calibration.tokens_sha256(a.samples)
    assert a.manifest().tokens == 4 * 64


def test_shipped_sets_load_and_heldout_is_disjoint_from_calibration() -> None:
    prose = calibration.load_documents("prose")
    code = calibration.load_documents("code")
    held = calibration.load_documents("heldout")
    mixed = calibration.load_documents("mixed")
    assert len(mixed.items) == len(prose.items) + len(code.items)
    assert held.items and not set(held.items) & set(prose.items + code.items)
    split = json.loads((Path(calibration.shipped_dir()).parent / "models/quantkit-tiny/split.json").read_text())
    assert len(split["prose"]["heldout"]) + len(split["code"]["heldout"]) == len(held.items)


def test_shorter_than_asked_is_an_error(tmp_path: Path, tok) -> None:
    p = tmp_path / "small.txt"
    p.write_text("just a few words " * 30)  # one sample of 64 tokens, not four
    with pytest.raises(CalibrationError, match="fewer than the 4 x 64") as e:
        calibration.build(spec(str(p)), tok)
    assert e.value.hint.startswith("ask for at most 1 samples of 64 tokens")


def test_empty_source_is_an_error(tmp_path: Path, tok) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(CalibrationError, match="empty"):
        calibration.build(spec(str(p)), tok)


def test_missing_field_names_the_fields(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"content": "hi"}) + "\n")
    with pytest.raises(CalibrationError, match="no 'text' field .fields: content"):
        calibration.load_documents(str(p))


def test_chat_template_samples_are_bounded(tmp_path: Path, tok) -> None:
    p = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}]} for t in TEXTS]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cs = calibration.build(spec(str(p), chat_template=True, seq_len=32), tok)
    assert len(cs.samples) == 4 and all(len(s) <= 32 for s in cs.samples)
    assert tok.decode(cs.samples[0]).startswith("<|begin_of_text|><|im_start|>user")


@pytest.mark.cli
def test_hub_name_offline_fails_clearly(cli, tiny: Path) -> None:
    """A hub dataset asked for offline is one line and exit 2, with a hint. In a process of its own: the hub
    libraries read HF_HUB_OFFLINE when they are imported, so setting it inside a test process that imported
    ``datasets`` earlier left it trying the network (23 s in the suite, and a pass only because no network answered)."""
    proc = cli("calib", "show", "wikitext2", "--model", tiny, "--samples", "2", "--seq-len", "32",
               env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: cannot load hub dataset 'wikitext2'" in proc.stderr and "Traceback" not in proc.stderr
    assert "OfflineModeIsEnabled" in proc.stderr and "hint: " in proc.stderr


@pytest.mark.cli
def test_calib_show_cli(cli, tiny: Path) -> None:
    proc = cli("calib", "show", "prose", "--model", tiny, "--samples", "2", "--seq-len", "32", "--json", check=True)
    info = json.loads(proc.stdout)
    assert info["calibration"]["tokens"] == 64 and len(info["calibration"]["tokens_sha256"]) == 64


@pytest.mark.cli
def test_calib_show_previews_a_conversation_as_its_messages(cli, tmp_path: Path) -> None:
    """A conversation was previewed as a Python repr (``[{'role': 'user', ...``); it is its messages, a line each,
    as packed samples and evaluation read it."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Name a colour."},
                                              {"role": "assistant", "content": "Blue."}]}) + "\n")
    info = json.loads(cli("calib", "show", chats, "--json", check=True).stdout)
    assert info["chat"] and info["preview"] == ["user: Name a colour.\nassistant: Blue."]


@pytest.mark.cli
def test_calib_show_refuses_values_out_of_bounds_in_one_line(cli, tiny: Path) -> None:
    """--samples 0 printed pydantic's ValidationError traceback (exit 1), and --show -1 was taken (previewing all
    documents but the last): each is now one line naming the flag, exit 2."""
    for flags, said in [(["--model", tiny, "--samples", "0"], "--samples 0: Input should be greater than or equal to 1"),
                        (["--show", "-1"], "--show -1")]:
        proc = cli("calib", "show", "mixed", *flags)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _parquet(path: Path, column: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": column}), path)
    return path


BAD_FILES = {  # file name -> (bytes, or a function writing it; the words of the one-line error)
    "nonstr.jsonl": (b'{"text": "fine"}\n{"text": 123}\n', "nonstr.jsonl:2: 'text' is 123 (int), neither text nor"),
    "nomessage.jsonl": (b'{"messages": [{"role": "user"}]}\n', "nomessage.jsonl:1: 'messages' is"),
    "records.json": (b'[{"text": "fine"}, {"text": {"a": 1}}]', "records.json: record 2: 'text' is {\"a\": 1} (dict)"),
    "scalar.json": (b"42", "scalar.json: the top level is a number; expected a JSON array of records"),
    "ints.parquet": (lambda p: _parquet(p, [1, 2]), "ints.parquet: row 1: 'text' is 1 (int)"),
    "bad.parquet": (b"not a parquet file\n", "bad.parquet is not a readable parquet file"),
    "latin1.txt": ("caf\xe9 cr\xe8me\n\nbr\xfbl\xe9e\n".encode("latin-1"),
                   "latin1.txt is not UTF-8 text: byte 0xe9 at offset 3 (line 1)"),
    "latin1.jsonl": (b'{"text": "ok"}\n' + '{"text": "caf\xe9"}\n'.encode("latin-1"),
                     "latin1.jsonl is not UTF-8 text: byte 0xe9 at offset 28 (line 2)"),
    "binary.txt": (bytes(range(128, 256)) * 4, "binary.txt is not UTF-8 text: byte 0x80 at offset 0 (line 1)"),
    "plain.jsonl.gz": (b'{"text": "not compressed"}\n', "plain.jsonl.gz is not a readable gzip file"),
    "latin1.txt.gz": (gzip.compress(b"ok\n\ncaf\xe9"), "byte 0xe9 at offset 7 of its decompressed text (line 3)"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_file_is_one_error_naming_it(tmp_path: Path, name: str) -> None:
    """A record that is neither text nor a conversation, a file that is not what its name says, or text that is not
    UTF-8: one CalibrationError (exit 2) naming the file and where, never a TypeError or pyarrow's error."""
    content, words = BAD_FILES[name]
    path = tmp_path / name
    content(path) if callable(content) else path.write_bytes(content)
    with pytest.raises(CalibrationError) as e:
        calibration.load_documents(str(path))
    assert words in str(e.value), str(e.value)
    assert "\n" not in e.value.message


def test_text_that_is_not_utf8_is_refused_with_a_hint_not_guessed(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("na\xefve".encode("latin-1"))
    with pytest.raises(CalibrationError) as e:
        calibration.load_documents(str(tmp_path / "latin1.txt"))
    assert "convert it to UTF-8" in e.value.hint and "does not guess" in e.value.hint


def test_windows_line_ends_make_the_same_documents(tmp_path: Path, tok) -> None:
    (tmp_path / "lf.txt").write_bytes("\n\n".join(TEXTS).encode())
    (tmp_path / "crlf.txt").write_bytes("\r\n\r\n".join(TEXTS).encode())
    lf, crlf = (calibration.build(spec(str(tmp_path / n)), tok) for n in ("lf.txt", "crlf.txt"))
    assert lf.documents.items == crlf.documents.items and lf.tokens_sha256 == crlf.tokens_sha256


def test_a_source_shorter_than_one_sample_says_so(tmp_path: Path, tok) -> None:
    p = tmp_path / "short.txt"
    p.write_text("a b c d")
    with pytest.raises(CalibrationError) as e:
        calibration.build(spec(str(p), samples=8, seq_len=128), tok)
    assert "holds 6 tokens, fewer than one sample of 128" in e.value.message and "at most" not in str(e.value)


@pytest.fixture(scope="module")
def source(tiny: Path):
    from quantkit import source as source_mod
    from quantkit.recipe import ModelSpec

    return source_mod.resolve(ModelSpec(source=str(tiny)))


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token cache of the test's own: an entry an earlier run left would let the check pass without tokenizing."""
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "cache"))


def _no_template(tmp_path: Path, tiny: Path) -> Path:
    """The reference model with its tokenizer's chat template taken out."""
    folder = tmp_path / "no-template"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).symlink_to(tiny / name)
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    return folder


@pytest.mark.usefixtures("own_cache")
@pytest.mark.parametrize("case", ["empty", "short", "too many samples", "not text", "chat without a template"])
def test_the_check_refuses_what_the_build_refuses_word_for_word(tmp_path: Path, tok, source, tiny: Path,
                                                                case: str) -> None:
    """``check`` (run by --dry-run and before a build loads anything) and ``build`` (the run's samples) refuse the
    same calibrations with the same message: the check tokenizes with the code the build does."""
    from transformers import AutoTokenizer

    from quantkit import source as source_mod
    from quantkit.recipe import ModelSpec

    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "short.txt").write_text("a b c d")
    (tmp_path / "nonstr.jsonl").write_text('{"text": 123}\n')
    asked = {"empty": spec(str(tmp_path / "empty.txt")),
             "short": spec(str(tmp_path / "short.txt"), samples=8, seq_len=128),
             "too many samples": spec("prose", samples=5000, seq_len=2048),
             "not text": spec(str(tmp_path / "nonstr.jsonl")),
             "chat without a template": spec("prose", chat_template=True)}[case]
    if case == "chat without a template":
        folder = _no_template(tmp_path, tiny)
        tok, source = AutoTokenizer.from_pretrained(folder), source_mod.resolve(ModelSpec(source=str(folder)))
    with pytest.raises(CalibrationError) as built:
        calibration.build(asked, tok)
    with pytest.raises(CalibrationError) as checked:
        calibration.check(asked, source)
    assert str(checked.value) == str(built.value)


@pytest.mark.usefixtures("own_cache")
def test_the_check_passes_what_the_build_makes_and_then_reads_its_tokens(tok, source, monkeypatch) -> None:
    """Tokens a run made from the same documents and tokenizer files pass the check without a tokenizer loaded."""
    from quantkit import source as source_mod

    asked = spec("prose", samples=8, seq_len=128)
    assert calibration.check(asked, source).endswith("1,024 tokens")
    calibration.build(asked, tok)
    monkeypatch.setattr(source_mod, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was loaded"))
    assert calibration.check(asked, source).endswith("their tokens made by an earlier run")


def test_the_check_leaves_a_hub_dataset_to_the_run(source) -> None:
    assert calibration.is_hub("wikitext2") and calibration.is_hub("org/name@train")
    assert "not checked offline" in calibration.check(spec("wikitext2"), source)


def test_the_check_refuses_images_for_a_text_model(source) -> None:
    with pytest.raises(UsageError, match="is not a vision-language model"):
        calibration.check(spec("prose", images="/nonexistent"), source)


@pytest.mark.cli
def test_a_bad_calibration_file_through_the_cli(cli, tiny: Path, tmp_path: Path) -> None:
    """Exit 2 with one line naming the file, no traceback, and with --json the error as stdout's one document;
    refused before the model loads, so nothing is written."""
    bad = tmp_path / "nonstr.jsonl"
    bad.write_text('{"text": 123}\n')
    for flags in (["--json"], ["--dry-run"]):
        proc = cli("gptq", tiny, tmp_path / "out", "--calib", bad, "--samples", "2", "--seq-len", "16", *flags)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith(f"error: {bad}:1: 'text' is 123 (int)") and "Traceback" not in proc.stderr
        if flags == ["--json"]:
            doc = json.loads(proc.stdout)
            assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"].startswith(f"{bad}:1:"), doc
        else:
            assert proc.stdout == ""
        assert not (tmp_path / "out").exists()


@pytest.mark.cli
@pytest.mark.parametrize("flags", [["--calib", "empty.txt"], ["--calib", "short.txt", "--samples", "8"],
                                   ["--calib", "prose", "--samples", "5000", "--seq-len", "2048"],
                                   ["--calib-images", "/nonexistent"]], ids=["empty", "short", "big", "images"])
def test_the_dry_run_refuses_what_the_run_would(cli, tiny: Path, tmp_path: Path, flags: list[str]) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("a b c d")
    proc = cli("gptq", tiny, tmp_path / "out", "--seq-len", "128", *flags, "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.cli
def test_the_run_refuses_a_short_source_as_its_dry_run_did(cli, tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("a b c d")
    runs = [cli("gptq", tiny, tmp_path / "out", "--calib", "short.txt", "--samples", "8", "--seq-len", "128", *flag,
                cwd=tmp_path) for flag in ([], ["--dry-run"])]
    assert [r.returncode for r in runs] == [2, 2]
    assert runs[0].stderr == runs[1].stderr and "fewer than one sample of 128" in runs[0].stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.cli
@pytest.mark.parametrize("argv", [["fp8", "--scheme", "dynamic"], ["gguf", "-t", "Q8_0"],
                                  ["nvfp4", "--algorithm", "rtn"]], ids=["fp8-dynamic", "gguf-q8_0", "nvfp4-rtn"])
def test_calibration_flags_a_method_does_not_read_are_said_not_used(cli, tiny: Path, tmp_path: Path,
                                                                    argv: list[str]) -> None:
    (tmp_path / "empty.txt").write_text("")
    proc = cli(argv[0], tiny, tmp_path / "out", *argv[1:], "--calib", "empty.txt", "--samples", "4", "--dry-run",
               "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (planned,) = json.loads(proc.stdout)["outputs"]
    assert planned["calibration"].startswith("none") and planned["notes"] == [
        f"--calib, --samples are not used: {argv[0]} reads no calibration data with these settings"]


@pytest.mark.cli
def test_the_run_warns_once_that_calibration_flags_are_not_used(cli, tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    proc = cli("fp8", tiny, tmp_path / "out", "--scheme", "dynamic", "--calib", "empty.txt", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)[0]["calibration"] is None
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: --calib is not used: fp8 reads no calibration data with these settings"]


@pytest.mark.cli
def test_a_hub_dataset_fails_fast_and_quietly_when_the_hub_does_not_answer(cli, tiny: Path, tmp_path: Path) -> None:
    """Not in offline mode, with a hub that refuses connections: one request, then the local cache only (empty
    here), not datasets' five retries with backoff (ten lines, about 23 seconds)."""
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    start = time.monotonic()
    proc = cli("calib", "show", "wikitext2", "--model", tiny, "--samples", "2", "--seq-len", "32", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert time.monotonic() - start < 20 and "Retrying" not in proc.stderr and "Traceback" not in proc.stderr
    assert "the hub does not answer (ConnectError" in proc.stderr


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json"])
def test_a_utf8_byte_order_mark_is_not_text(tmp_path: Path, tok, kind: str) -> None:
    """A file saved with a UTF-8 byte order mark (Windows Notepad, Excel's "UTF-8" export) reads as the same
    documents and tokens as without it: the mark went into a .txt's first document as a token of its own (and into
    every evaluation of that text), and a .jsonl or .json was refused with json's "decode using utf-8-sig"."""
    body = {"txt": "\n\n".join(TEXTS), "jsonl": "".join(json.dumps({"text": t}) + "\n" for t in TEXTS),
            "json": json.dumps([{"text": t} for t in TEXTS])}[kind].encode()
    (tmp_path / f"plain.{kind}").write_bytes(body)
    (tmp_path / f"bom.{kind}").write_bytes(b"\xef\xbb\xbf" + body)
    plain, bom = (calibration.build(spec(str(tmp_path / f"{n}.{kind}")), tok) for n in ("plain", "bom"))
    assert bom.documents.items == plain.documents.items and bom.tokens_sha256 == plain.tokens_sha256
    texts = {n: calibration.eval_text(str(tmp_path / f"{n}.{kind}"))[0] for n in ("plain", "bom")}
    assert texts["bom"] == texts["plain"]


@pytest.mark.parametrize("where", ["plain.txt", "prose", "wikitext2"])
def test_a_text_field_where_there_are_no_fields_is_refused_not_ignored(tmp_path: Path, where: str) -> None:
    """A text field (--calib-field body) given with a plain-text file, a shipped set or a hub alias (which names its
    own column) was silently ignored: the run calibrated on the whole text, and the manifest recorded the field as
    if it had chosen something. It is refused, by the check (--dry-run, before any model or hub dataset loads) and
    by the build alike."""
    (tmp_path / "plain.txt").write_text("\n\n".join(TEXTS))
    name = str(tmp_path / where) if where.endswith(".txt") else where
    with pytest.raises(CalibrationError, match="text field 'body'") as e:
        calibration.load_documents(name, "body")
    assert "leave the field at its default" in e.value.hint


@pytest.mark.usefixtures("own_cache")
def test_the_check_refuses_a_text_field_a_hub_alias_does_not_read(source) -> None:
    with pytest.raises(CalibrationError, match="text field 'body'"):
        calibration.check(spec("wikitext2", field="body"), source)
    assert "not checked offline" in calibration.check(spec("ultrachat", field="messages"), source)


@pytest.mark.cli
def test_a_missing_text_field_names_the_flag_of_the_command_that_read_it(cli, tiny: Path, tmp_path: Path) -> None:
    """A record without the text field said "choose the text field with --calib-field / calibration.field" to every
    command: `calib show` has --field, and `eval` had no way to choose one; it has --field (evaluation.field)."""
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    show = cli("calib", "show", body)
    assert show.returncode == 2 and "Traceback" not in show.stderr, show.stderr
    assert "calib show's --field" in show.stderr and f"error: {body}:1: no 'text' field" in show.stderr
    ev = cli("eval", tiny, "--baseline", tiny, "--dataset", body, "--max-tokens", "64", "--report-dir", tmp_path / "r")
    assert ev.returncode == 2 and "Traceback" not in ev.stderr, ev.stderr
    assert f"error: {body}:1: no 'text' field" in ev.stderr and "--calib-field" not in ev.stderr, ev.stderr
    assert "eval's --field, or the recipe's evaluation.field" in ev.stderr, ev.stderr
    ev = cli("eval", tiny, "--baseline", tiny, "--dataset", body, "--field", "body", "--max-tokens", "64",
             "--report-dir", tmp_path / "r", "--json")
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["protocol"]["text_sha256"] == hashlib.sha256("\n\n".join(TEXTS).encode()).hexdigest()


@pytest.mark.cli
def test_calib_list_and_show_print_names_with_brackets_as_they_are(cli, tmp_path: Path) -> None:
    """`calib list` and `calib show` printed names through Rich markup, which takes "[...]" for a tag: the list's
    hub row said org/name[:config] (no "[@split]", as if no split could be named), `calib show 'calib[v2].txt'`
    named calib.txt, and a file under a folder named "[" ("[/]x.txt") was a MarkupError traceback."""
    listed = cli("calib", "list", env={"COLUMNS": "200"}, check=True)
    assert "org/name[:config][@split]" in listed.stdout, listed.stdout
    (tmp_path / "[").mkdir()
    for name in ("calib[v2].txt", "[/]x.txt"):
        (tmp_path / name).write_text("\n\n".join(TEXTS))
        proc = cli("calib", "show", name, "--show", "0", cwd=tmp_path)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stdout.startswith(f"{name} (file): 12 documents"), proc.stdout


def _conversation(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: " + "why is the sky blue? " * 20},
                         {"role": "assistant", "content": "Rayleigh scattering. " * 20}]}


def test_a_null_conversation_leaves_the_others_chat(tmp_path: Path, tok) -> None:
    """A null record counts as an empty document (docs/calibration.md), but one ``"messages": null`` in a file of
    conversations made the file plain text: every conversation was packed as "user: ..." lines, never through the
    chat template, with nothing said. It is left out, and the rest are the conversations they were."""
    rows = "".join(json.dumps(_conversation(i)) + "\n" for i in range(8))
    (tmp_path / "chat.jsonl").write_text(rows)
    (tmp_path / "null.jsonl").write_text(rows + json.dumps({"messages": None}) + "\n")
    chat, null = (calibration.build(spec(str(tmp_path / n)), tok) for n in ("chat.jsonl", "null.jsonl"))
    assert null.documents.chat and null.chat and null.samples == chat.samples


@pytest.mark.usefixtures("own_cache")
def test_texts_and_conversations_in_one_file_are_not_packed(tmp_path: Path, tok, source) -> None:
    """A file of conversations with a plain-text record among them was calibrated as packed plain text (the chat
    template off, as for the base model quantkit-tiny), its conversations as "user: ..." lines no model is served.
    Packed, such a mix is refused, by the check and the build alike; through the template both kinds render."""
    p = tmp_path / "mixed.jsonl"
    p.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(8)) + json.dumps({"text": TEXTS[0]}) + "\n")
    with pytest.raises(CalibrationError) as built:
        calibration.build(spec(str(p)), tok)
    assert "8 conversations and 1 plain text" in built.value.message and "--chat-template" in built.value.hint
    with pytest.raises(CalibrationError) as checked:
        calibration.check(spec(str(p)), source)
    assert str(checked.value) == str(built.value)
    templated = calibration.build(spec(str(p), chat_template=True), tok)
    assert templated.chat and all(tok.decode(s).startswith("<|begin_of_text|><|im_start|>") for s in templated.samples)
    assert calibration.eval_text(str(p))[0].startswith("user: Question 0")  # evaluation reads both, as text


@pytest.mark.usefixtures("own_cache")
@pytest.mark.parametrize("name", ["data/calib.jsonl", "sub/heldout.txt", "out/rows.parquet", "runs/a.csv"])
def test_a_missing_file_in_a_folder_is_not_taken_for_a_hub_dataset(tmp_path: Path, source, name: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped path with a folder in it ("data/calib.jsonl") read as a hub id org/name: --dry-run passed it ("read
    when the run starts"), and the run, eval and calib show failed with "cannot load hub dataset ... the hub may be
    unreachable", about a file that was never there. A name with a data file's suffix is a local file: missing, it
    is one line saying so, before anything loads."""
    monkeypatch.chdir(tmp_path)
    assert not calibration.is_hub(name)
    with pytest.raises(CalibrationError, match=f"no such file: {name}") as e:
        calibration.check(spec(name), source)
    assert str(tmp_path / name) in e.value.message and "hub" not in e.value.message
    assert calibration.is_hub("allenai/c4") and calibration.is_hub("org/name:config@train")


@pytest.mark.cli
def test_a_fifo_as_a_text_source_is_refused_not_waited_on(cli, tmp_path: Path) -> None:
    """A FIFO named like a data file (calib.txt) was read, and calib show, eval and the quantize verbs waited for a
    writer for ever. A source is read more than once (the check, the build, its sha256), so a pipe could never
    serve; anything but a regular file is one line naming it, exit 2."""
    import os
    import subprocess

    os.mkfifo(tmp_path / "calib.txt")
    try:
        proc = cli("calib", "show", tmp_path / "calib.txt", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("calib show waited on the FIFO")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: text source {tmp_path / 'calib.txt'} is not a regular file"), proc.stderr
