"""The bad-input catalogue of issue #6: every bad input gets one clear line (exit code 2) and leaves no output.
Issue #14 (outputs: never destroy what is not ours, preflight, no traceback for a file-system error) is
tests/test_output_safety.py.

Items tested elsewhere (not repeated here):
  invalid JSON line (line number) ............ test_sharding_inputs.py::test_bad_rows_get_one_line_errors
  missing text column ........................ test_sharding.py::test_bad_inputs_get_clear_errors_and_leave_nothing,
                                               test_sharding_inputs.py::test_bad_rows_get_one_line_errors
  empty corpus / emptied by filters .......... test_sharding.py::test_bad_inputs_get_clear_errors_and_leave_nothing
  fewer documents than paths ................. test_sharding.py::test_bad_inputs_get_clear_errors_and_leave_nothing
  run dir from an incompatible config ........ test_reliability.py::test_existing_run_is_not_overwritten
  corrupt / truncated safetensors ............ test_reliability.py::test_damaged_checkpoints_get_clear_errors
  unknown config keys, wrong types ........... test_config.py, test_reliability.py::test_config_overrides_never_crash
  grid / level split that does not fit ....... test_reliability.py::test_grid_that_does_not_fit_the_model, test_grid.py
  streaming settings that do not fit ......... test_streaming.py::test_bad_configs_are_rejected
  prompt of zero tokens ...................... test_eval_generate.py::test_bad_inputs
"""

import ast
import gzip
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.sharding.sources import iter_documents, iter_rows
from dipaco.sharding.writer import shard
from dipaco.training.train import train

from conftest import one_error_line, sets_of_tiny_train, shard_config

PACKAGE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def docs(corpus_file):
    return [json.loads(line) for line in open(corpus_file, encoding="utf-8")]


def _shard_cli(data, out, *extra) -> int:
    return main(["shard", "--data", *map(str, data), "--out", str(out), "--grid", "2", "--quiet", *extra])


def _nothing_left(out: Path) -> None:
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp*"))


# --------------------------------------------------------------------------------- corpus files
def test_missing_and_unreadable_inputs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert _shard_cli([tmp_path / "missing.jsonl"], out) == 2
    assert "does not exist" in one_error_line(capsys, "shard")
    (tmp_path / "empty_dir").mkdir()
    assert _shard_cli([tmp_path / "empty_dir"], out) == 2
    assert "holds no .jsonl" in one_error_line(capsys, "shard")
    odd = tmp_path / "corpus.docx"
    odd.write_text("x")
    assert _shard_cli([odd], out) == 2
    assert "unknown file type" in one_error_line(capsys, "shard")
    f = tmp_path / "locked.jsonl"
    f.write_text('{"text": "x"}\n')
    import dipaco.sharding.sources as sources

    access = sources.os.access
    monkeypatch.setattr(sources.os, "access", lambda p, *a: Path(p) != f and access(p, *a))  # chmod 000 does not stop root
    assert _shard_cli([f], out) == 2
    assert "is not readable; fix its permissions" in one_error_line(capsys, "shard")
    _nothing_left(out)


_PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"


@pytest.mark.parametrize("name,content,needle", [
    ("nul.jsonl", b'{"text": "a"}\x00\x00\x01\x02\n', "looks binary (NUL bytes)"),
    ("later.jsonl", b'{"text": "fine"}\n' * 3 + b'{"text": "x\x00y"}\n', "looks binary (NUL bytes on line 4)"),
    ("packed.jsonl", gzip.compress(b'{"text": "hello"}\n' * 20), "looks binary (gzip-compressed data); name it packed.jsonl.gz"),
    ("image.jsonl", _PNG, "looks binary (a PNG image)"),
    ("image.csv", _PNG, "looks binary (a PNG image)"),
    ("utf16.jsonl", '{"text": "hello"}\n'.encode("utf-16"), "looks binary (UTF-16 text)"),
    ("fake.jsonl.gz", b'{"text": "not compressed"}\n', "cannot decompress"),
    ("cut.jsonl.gz", gzip.compress(b'{"text": "hello"}\n' * 200)[:40], "cannot decompress"),
])
def test_binary_input_is_reported_as_binary(tmp_path, capsys, name, content, needle):
    f = tmp_path / name
    f.write_bytes(content)
    out = tmp_path / "out"
    assert _shard_cli([f], out) == 2
    err = one_error_line(capsys, "shard")
    assert needle in err and str(f) in err and "JSON" not in err.split("give")[0], err
    _nothing_left(out)


def test_binary_text_file_is_dropped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("plain words " * 20)
    (tmp_path / "b.txt").write_bytes(_PNG)  # a stray image in a directory of text files
    from dipaco.sharding.sources import DocumentFilter

    filt = DocumentFilter()
    assert [d.text[:5] for d in iter_documents([str(tmp_path)], filt=filt)] == ["plain"]
    assert filt.report()["binary"] == 1


def test_invalid_utf8_is_counted_and_a_foreign_encoding_refused(docs, shards_2x2, tmp_path, capsys):
    src = tmp_path / "mixed.jsonl"
    with open(src, "wb") as f:
        for r in docs:
            f.write((json.dumps({"text": r["text"], "domain": r["domain"]}) + "\n").encode())
        for i in range(3):  # three records with a Latin-1 byte in the text: kept, repaired, counted
            f.write(f'{{"text": "caf\xe9 number {i} ' .encode("latin-1") + b"and more words " * 8 + b'"}\n')
        for value in (12345, None, ["a", "list"], {"an": "object"}, 1.5, True):  # not text: dropped and counted
            f.write((json.dumps({"text": value}) + "\n").encode())
    out = tmp_path / "s"
    assert _shard_cli([src], out, "--tokenizer", str(shards_2x2 / "tokenizer"), "--set", "routing.svd_dims=16") == 0
    assert "invalid UTF-8 replaced in 3" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["invalid_utf8"] == 3 and m["dropped"]["not_text"] == 5 and m["dropped"]["missing_text"] == 1

    latin = tmp_path / "latin1.jsonl"  # a whole file in another encoding
    latin.write_bytes(b"".join(f'{{"text": "r\xe9sum\xe9 {i} "}}\n'.encode("latin-1") for i in range(10)))
    assert _shard_cli([latin], tmp_path / "s2") == 2
    err = one_error_line(capsys, "shard")
    assert f"input {latin}: 10 of 10 records are not valid UTF-8" in err and "convert it to UTF-8" in err
    _nothing_left(tmp_path / "s2")


_BIG_DOC = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, sys.argv[3])
    from conftest import shard_config
    from dipaco.sharding.writer import shard
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    m = shard([sys.argv[1]], shard_config("1"), sys.argv[2], tokenizer_dir=sys.argv[4], progress=False)
    print(json.dumps({"seconds": time.perf_counter() - began, "documents": m["documents"], "truncated": m["truncated"],
                      "tokens": m["tokens"], "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
""")


def test_a_single_100mb_document_is_cut_not_fatal(docs, shards_2x2, tmp_path):
    src = tmp_path / "big.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[0]["text"]}) + "\n")
        f.write('{"text": "')
        chunk = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB
        for _ in range(100):
            f.write(chunk)
        f.write('", "domain": "huge"}\n')
        for r in docs[1:30]:
            f.write(json.dumps({"text": r["text"]}) + "\n")
    assert src.stat().st_size > 100e6
    proc = subprocess.run([sys.executable, "-c", _BIG_DOC, str(src), str(tmp_path / "s"), str(Path(__file__).parent),
                           str(shards_2x2 / "tokenizer")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"100 MB document: {result}")
    assert result["truncated"] == 1 and result["documents"] == 31
    assert result["rss_growth_mb"] < 1500  # measured ~400 MB: the line, its decoded text and the parsed string
    assert result["seconds"] < 120  # measured ~4 s on 2 shared cores


# ------------------------------------------------------------------------------------- fuzzing
_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=80),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                            max_leaves=8)
_records = st.one_of(
    st.dictionaries(st.sampled_from(["text", "domain", "other"]), _json_values, max_size=3).map(json.dumps),
    _json_values.map(json.dumps),
    st.text(max_size=40),
)
_files = st.one_of(
    st.lists(_records, max_size=6).map(lambda lines: "\n".join(lines).encode()),
    st.binary(max_size=300),
    st.lists(st.one_of(st.binary(max_size=40), _records.map(str.encode)), max_size=6).map(b"\n".join),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=_files, suffix=st.sampled_from([".jsonl", ".json", ".csv", ".txt", ".jsonl.gz", ".csv.gz"]),
       compress=st.booleans())
def test_corpus_reader_fuzz(tmp_path, content, suffix, compress):
    """Arbitrary bytes, JSON lines and wrong types in the text column: documents or a DipacoError, nothing else."""
    f = tmp_path / f"fuzz{suffix}"
    f.write_bytes(gzip.compress(content) if compress and suffix.endswith(".gz") else content)
    try:
        for doc in iter_documents([str(f)], min_chars=1):
            assert isinstance(doc.text, str) and doc.text and "\x00" not in doc.text
    except DipacoError as exc:
        assert "\n" not in str(exc)


_shard_cache: dict = {}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(values=st.lists(_json_values, max_size=8), real=st.integers(0, 8))
def test_shard_stage_fuzz(docs, shards_2x2, tmp_path_factory, values, real):
    """Whole shard runs on fuzzed records mixed with real ones: a complete directory or a DipacoError and no
    directory at all (nothing half-written)."""
    root = tmp_path_factory.mktemp("fuzz")
    src = root / "in.jsonl"
    rows = [{"text": d["text"]} for d in docs[:real]] + [{"text": v} for v in values]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = root / "out"
    cfg = shard_config("2", "data.min_chars=1", "data.heldout_fraction=0", "data.router_fraction=0")
    try:
        shard([str(src)], cfg, out, tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    except DipacoError:
        _nothing_left(out)
    else:
        assert (out / "manifest.json").is_file()


# --------------------------------------------------------------------- runs against other shards
@pytest.fixture(scope="module")
def other_shards(docs, shards_2x2, tmp_path_factory):
    """Shards of the same texts made another way: `tok` with its own tokenizer (same vocabulary size) and
    router, `router` with the tokenizer of shards_2x2 but another router."""
    root = tmp_path_factory.mktemp("other")
    src = root / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d["text"]}) + "\n" for d in docs[::4]), encoding="utf-8")
    tok = shard([str(src)], shard_config("2x2", "seed=7"), root / "tok", progress=False)
    router = shard([str(src)], shard_config("2x2", "seed=7"), root / "router", progress=False,
                   tokenizer_dir=str(shards_2x2 / "tokenizer"))
    base = json.loads((shards_2x2 / "manifest.json").read_text())
    assert tok["tokenizer"]["sha256"] != base["tokenizer"]["sha256"] and tok["vocab_size"] == base["vocab_size"]
    assert router["tokenizer"]["sha256"] == base["tokenizer"]["sha256"] and router["fingerprint"] != base["fingerprint"]
    return {"tok": root / "tok", "router": root / "router"}


def test_resume_on_other_shards(small_runs, other_shards, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(small_runs / "dipaco", run)
    for other in ("tok", "router"):
        for workers in ([], ["--workers", "2"]):  # --workers: checked once before torchrun starts any worker
            assert main(["train", "--shards", str(other_shards[other]), "--out", str(run), "--resume", "--quiet",
                         "--rounds", "2", "--inner-steps", "2", *sets_of_tiny_train(), *workers]) == 2
            err = one_error_line(capsys, "train")
            assert f"cannot resume {run}: it was trained on other shards" in err and "pass those --shards" in err
    assert not (run / "checkpoints" / "round_2").exists()


def test_workers_preflight(small_runs, shards_2x2, tmp_path, capsys):
    """`--workers N` checks its inputs before launching torchrun: one line, exit code 2, no worker started."""
    base = ["train", "--shards", str(shards_2x2), "--quiet", "--rounds", "2", "--inner-steps", "2", *sets_of_tiny_train()]
    assert main([*base, "--out", str(small_runs / "dipaco"), "--workers", "2"]) == 2
    assert "already holds a run (round 1); pass --resume" in one_error_line(capsys, "train")
    assert main([*base, "--out", str(tmp_path / "r"), "--workers", "5"]) == 2
    assert "5 workers but only 4 trainees" in one_error_line(capsys, "train")
    assert main([*base, "--out", str(small_runs / "dipaco"), "--workers", "2", "--resume", "--set", "model.num_layers=2"]) == 2
    assert "config 'model' differs" in one_error_line(capsys, "train")
    assert main([*base, "--out", str(tmp_path / "r"), "--workers", "2", "--set", "grid.level_sizes=[1, 1]"]) == 2
    assert "level_sizes" in one_error_line(capsys, "train")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("other,needle", [("tok", "trained with another tokenizer than"),
                                          ("router", "trained on other shards (another router) than")])
def test_eval_and_generate_with_other_shards(small_runs, other_shards, tmp_path, capsys, other, needle):
    run, shards = small_runs / "dipaco", other_shards[other]
    assert main(["eval", "--run", str(run), "--shards", str(shards), "--out", str(tmp_path / "r.json"), "--quiet"]) == 2
    err = one_error_line(capsys, "eval")
    assert needle in err and str(shards) in err and "--shards" in err
    assert not (tmp_path / "r.json").exists()
    assert main(["generate", "--run", str(run), "--shards", str(shards), "--quiet", "int main"]) == 2
    assert needle in one_error_line(capsys, "generate")
    assert main(["export", "--run", str(run), "--shards", str(shards), "--path", "0-0", "--out", str(tmp_path / "x"),
                 "--quiet"]) == 2
    assert needle in one_error_line(capsys, "export")
    assert not (tmp_path / "x").exists()


def test_init_from_a_dense_model_with_another_tokenizer(small_runs, other_shards, tmp_path, capsys):
    dense = small_runs / "dense"
    out = tmp_path / "run"
    assert main(["train", "--shards", str(other_shards["tok"]), "--out", str(out), "--init-from", str(dense),
                 "--quiet", "--rounds", "1", "--inner-steps", "1", *sets_of_tiny_train()]) == 2
    err = one_error_line(capsys, "train")
    assert f"--init-from {dense} was trained with another tokenizer than --shards {other_shards['tok']}" in err
    assert f"re-shard with --tokenizer {json.loads((dense / 'run.json').read_text())['shards_dir']}/tokenizer" in err
    assert not out.exists()
    # an exported Hugging Face directory carries its tokenizer: the same check applies
    export = tmp_path / "export"
    assert main(["export", "--run", str(dense), "--path", "0", "--out", str(export), "--quiet"]) == 0
    assert not capsys.readouterr().err  # --quiet: no progress bars
    assert main(["train", "--shards", str(other_shards["tok"]), "--out", str(out), "--init-from", str(export),
                 "--quiet", "--rounds", "1", "--inner-steps", "1", *sets_of_tiny_train()]) == 2
    assert "was trained with another tokenizer" in one_error_line(capsys, "train")
    # same tokenizer, another router: a dense start is fine
    assert main(["train", "--shards", str(other_shards["router"]), "--out", str(out), "--init-from", str(export),
                 "--quiet", "--rounds", "1", "--inner-steps", "1", *sets_of_tiny_train()]) == 0
    capsys.readouterr()
    # a pickled checkpoint is never loaded
    (export / "model.safetensors").unlink()
    (export / "pytorch_model.bin").write_bytes(b"not even a pickle")
    assert main(["train", "--shards", str(shards_dir := other_shards["router"]), "--out", str(tmp_path / "r2"),
                 "--init-from", str(export), "--quiet", "--rounds", "1", "--inner-steps", "1", *sets_of_tiny_train()]) == 2
    assert "not a loadable Hugging Face Llama directory" in one_error_line(capsys, "train")
    assert shards_dir.exists() and not (tmp_path / "r2").exists()


# ------------------------------------------------------------------------------ nothing unpickled
def test_loading_never_unpickles():
    """Every torch.load passes weights_only=True; no pickle, no np.load(allow_pickle=True), no eval."""
    sources = [p for d in ("dipaco", "routing", "sharding", "eval") for p in (PACKAGE / d).rglob("*.py")]
    assert len(sources) > 20
    loads = 0
    for p in sources:
        text = p.read_text(encoding="utf-8")
        tree = ast.parse(text)
        calls = {id(c.func): c for c in ast.walk(tree) if isinstance(c, ast.Call)}
        for node in ast.walk(tree):  # every use of torch.load is a call that passes weights_only=True
            if isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", None) == "torch":
                call = calls.get(id(node))
                assert call is not None, (p, node.lineno, "torch.load used other than by a call")
                assert any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in call.keywords), \
                    (p, node.lineno)
                loads += 1
        assert not re.search(r"^\s*import pickle|^\s*from pickle|pickle\.loads?\(|allow_pickle=True|(?<![.\w])eval\(",
                             text, re.M), p
    assert loads >= 6  # the checkpoint, task store, phase and worker-pool loads were all seen
