"""The bad-input catalogue of issue #6: every bad input gets one clear line (exit code 2) and leaves no output.
Issue #14 (outputs: never destroy what is not ours, preflight, no traceback for a file-system error) is the
table _OUTPUT_CASES and the tests after it.

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

from conftest import TINY_TRAIN, shard_config, tiny_train_config

PACKAGE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def docs(corpus_file):
    return [json.loads(line) for line in open(corpus_file, encoding="utf-8")]


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dipaco {command}: error: "), err
    return err


def _shard_cli(data, out, *extra) -> int:
    return main(["shard", "--data", *map(str, data), "--out", str(out), "--grid", "2", "--quiet", *extra])


def _nothing_left(out: Path) -> None:
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp*"))


# --------------------------------------------------------------------------------- corpus files
def test_missing_and_unreadable_inputs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert _shard_cli([tmp_path / "missing.jsonl"], out) == 2
    assert "does not exist" in _one_error_line(capsys, "shard")
    (tmp_path / "empty_dir").mkdir()
    assert _shard_cli([tmp_path / "empty_dir"], out) == 2
    assert "holds no .jsonl" in _one_error_line(capsys, "shard")
    odd = tmp_path / "corpus.docx"
    odd.write_text("x")
    assert _shard_cli([odd], out) == 2
    assert "unknown file type" in _one_error_line(capsys, "shard")
    f = tmp_path / "locked.jsonl"
    f.write_text('{"text": "x"}\n')
    import dipaco.sharding.sources as sources

    access = sources.os.access
    monkeypatch.setattr(sources.os, "access", lambda p, *a: Path(p) != f and access(p, *a))  # chmod 000 does not stop root
    assert _shard_cli([f], out) == 2
    assert "is not readable; fix its permissions" in _one_error_line(capsys, "shard")
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
    err = _one_error_line(capsys, "shard")
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
    err = _one_error_line(capsys, "shard")
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


@pytest.fixture(scope="module")
def small_runs(shards_2x2, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train(tiny_train_config("val_batches=0", rounds=1, inner_steps=2), shards_2x2, root / "dipaco", progress=False)
    train(tiny_train_config("val_batches=0", 'grid.shape="1"', rounds=1, inner_steps=2), shards_2x2, root / "dense",
          progress=False)
    return root


def _sets():
    return [a for kv in [*TINY_TRAIN, "val_batches=0"] for a in ("--set", kv)]


def test_resume_on_other_shards(small_runs, other_shards, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(small_runs / "dipaco", run)
    for other in ("tok", "router"):
        for workers in ([], ["--workers", "2"]):  # --workers: checked once before torchrun starts any worker
            assert main(["train", "--shards", str(other_shards[other]), "--out", str(run), "--resume", "--quiet",
                         "--rounds", "2", "--inner-steps", "2", *_sets(), *workers]) == 2
            err = _one_error_line(capsys, "train")
            assert f"cannot resume {run}: it was trained on other shards" in err and "pass those --shards" in err
    assert not (run / "checkpoints" / "round_2").exists()


def test_workers_preflight(small_runs, shards_2x2, tmp_path, capsys):
    """`--workers N` checks its inputs before launching torchrun: one line, exit code 2, no worker started."""
    base = ["train", "--shards", str(shards_2x2), "--quiet", "--rounds", "2", "--inner-steps", "2", *_sets()]
    assert main([*base, "--out", str(small_runs / "dipaco"), "--workers", "2"]) == 2
    assert "already holds a run (round 1); pass --resume" in _one_error_line(capsys, "train")
    assert main([*base, "--out", str(tmp_path / "r"), "--workers", "5"]) == 2
    assert "5 workers but only 4 trainees" in _one_error_line(capsys, "train")
    assert main([*base, "--out", str(small_runs / "dipaco"), "--workers", "2", "--resume", "--set", "model.num_layers=2"]) == 2
    assert "config 'model' differs" in _one_error_line(capsys, "train")
    assert main([*base, "--out", str(tmp_path / "r"), "--workers", "2", "--set", "grid.level_sizes=[1, 1]"]) == 2
    assert "level_sizes" in _one_error_line(capsys, "train")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("other,needle", [("tok", "trained with another tokenizer than"),
                                          ("router", "trained on other shards (another router) than")])
def test_eval_and_generate_with_other_shards(small_runs, other_shards, tmp_path, capsys, other, needle):
    run, shards = small_runs / "dipaco", other_shards[other]
    assert main(["eval", "--run", str(run), "--shards", str(shards), "--out", str(tmp_path / "r.json"), "--quiet"]) == 2
    err = _one_error_line(capsys, "eval")
    assert needle in err and str(shards) in err and "--shards" in err
    assert not (tmp_path / "r.json").exists()
    assert main(["generate", "--run", str(run), "--shards", str(shards), "--quiet", "int main"]) == 2
    assert needle in _one_error_line(capsys, "generate")
    assert main(["export", "--run", str(run), "--shards", str(shards), "--path", "0-0", "--out", str(tmp_path / "x"),
                 "--quiet"]) == 2
    assert needle in _one_error_line(capsys, "export")
    assert not (tmp_path / "x").exists()


def test_init_from_a_dense_model_with_another_tokenizer(small_runs, other_shards, tmp_path, capsys):
    dense = small_runs / "dense"
    out = tmp_path / "run"
    assert main(["train", "--shards", str(other_shards["tok"]), "--out", str(out), "--init-from", str(dense),
                 "--quiet", "--rounds", "1", "--inner-steps", "1", *_sets()]) == 2
    err = _one_error_line(capsys, "train")
    assert f"--init-from {dense} was trained with another tokenizer than --shards {other_shards['tok']}" in err
    assert f"re-shard with --tokenizer {json.loads((dense / 'run.json').read_text())['shards_dir']}/tokenizer" in err
    assert not out.exists()
    # an exported Hugging Face directory carries its tokenizer: the same check applies
    export = tmp_path / "export"
    assert main(["export", "--run", str(dense), "--path", "0", "--out", str(export), "--quiet"]) == 0
    assert not capsys.readouterr().err  # --quiet: no progress bars
    assert main(["train", "--shards", str(other_shards["tok"]), "--out", str(out), "--init-from", str(export),
                 "--quiet", "--rounds", "1", "--inner-steps", "1", *_sets()]) == 2
    assert "was trained with another tokenizer" in _one_error_line(capsys, "train")
    # same tokenizer, another router: a dense start is fine
    assert main(["train", "--shards", str(other_shards["router"]), "--out", str(out), "--init-from", str(export),
                 "--quiet", "--rounds", "1", "--inner-steps", "1", *_sets()]) == 0
    capsys.readouterr()
    # a pickled checkpoint is never loaded
    (export / "model.safetensors").unlink()
    (export / "pytorch_model.bin").write_bytes(b"not even a pickle")
    assert main(["train", "--shards", str(shards_dir := other_shards["router"]), "--out", str(tmp_path / "r2"),
                 "--init-from", str(export), "--quiet", "--rounds", "1", "--inner-steps", "1", *_sets()]) == 2
    assert "not a loadable Hugging Face Llama directory" in _one_error_line(capsys, "train")
    assert shards_dir.exists() and not (tmp_path / "r2").exists()


# ------------------------------------------------------------------------------ nothing unpickled
def test_loading_never_unpickles():
    """Every torch.load passes weights_only=True; no pickle, no np.load(allow_pickle=True), no eval."""
    sources = [p for d in ("dipaco", "routing", "sharding", "eval") for p in (PACKAGE / d).rglob("*.py")]
    assert len(sources) > 20
    for p in sources:
        text = p.read_text(encoding="utf-8")
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (p, call)
        assert not re.search(r"^\s*import pickle|^\s*from pickle|pickle\.loads?\(|allow_pickle=True|(?<![.\w])eval\(",
                             text, re.M), p


# ----------------------------------------------------------------- outputs: never destroy what is not ours
# Issue #14. Every case runs in a directory of the user's own things (_user_world); the command must exit with
# code 2 and one line, and every file that existed before (the world, the shards, the runs) must be
# byte-identical afterwards, with nothing added (no temporary or .old file).
def _user_world(root: Path, corpus_file: Path) -> None:
    lines = corpus_file.read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "mydir").mkdir()
    for i in range(3):  # the user's corpus folder
        (root / "mydir" / f"part{i}.jsonl").write_text("".join(lines[i::3]), encoding="utf-8")
    (root / "afile").write_text("a regular file\n")
    (root / "userdir").mkdir()
    (root / "userdir" / "notes.txt").write_text("my notes\n")
    (root / "mine").mkdir()  # the user's own files under the names train writes
    (root / "mine" / "metrics.jsonl").write_text('{"mine": 1}\n')
    (root / "mine" / "config.toml").write_text("mine = true\n")
    (root / "emptydir").mkdir()
    (root / "ro").mkdir()  # "read-only": os.access says so (chmod does not stop root)
    (root / "user.png").write_bytes(_PNG)
    (root / "rep.md").write_text("# my report notes\n")
    (root / "bin.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    (root / "latin.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))


def _snapshot(*roots: Path) -> dict[str, str]:
    from dipaco.io import sha256_file

    return {str(p): (sha256_file(p) if p.is_file() else "dir") for root in roots for p in [root, *root.rglob("*")]}


_T = ["--rounds", "1", "--inner-steps", "1", "--quiet"]
_S = ["--grid", "2", "--vocab-size", "512", "--quiet"]
_OUTPUT_CASES = [
    # the three data-loss cases of the issue, and their relatives
    ("shard-out-is-data", ["shard", "--data", "{t}/mydir", "--out", "{t}/mydir", "--overwrite", *_S], "is the input --data"),
    ("train-out-holds-users-files", ["train", "--shards", "{shards}", "--out", "{t}/mine", *_T],
     "holds files dipaco did not write (config.toml, metrics.jsonl)"),
    ("train-out-is-shards", ["train", "--shards", "{shards}", "--out", "{shards}", *_T], "is the input --shards"),
    ("shard-overwrite-users-dir", ["shard", "--data", "{t}/mydir", "--out", "{t}/userdir", "--overwrite", *_S],
     "holds files dipaco did not write (notes.txt); choose a new or empty directory; --overwrite only replaces"),
    ("shard-out-contains-data", ["shard", "--data", "{t}/mydir/part0.jsonl", "--out", "{t}/mydir", *_S],
     "contains the input --data"),
    ("train-out-inside-shards", ["train", "--shards", "{shards}", "--out", "{shards}/run", *_T], "lies inside the input --shards"),
    ("reshard-out-is-shards", ["reshard", "--run", "{run}", "--shards", "{shards}", "--out", "{shards}", "--overwrite", "--quiet"],
     "is the input --shards"),
    ("export-over-shards", ["export", "--run", "{run}", "--path", "0-0", "--out", "{shards}", "--overwrite", "--quiet"],
     "is a dipaco shard directory, not a dipaco export"),
    ("export-over-users-dir", ["export", "--run", "{run}", "--path", "0-0", "--out", "{t}/userdir", "--overwrite", "--quiet"],
     "holds files dipaco did not write (notes.txt)"),
    ("quickstart-users-dir", ["quickstart", "--out", "{t}/userdir", "--quiet"], "holds files dipaco did not write"),
    ("shard-empty-dir-needs-overwrite", ["shard", "--data", "{t}/mydir", "--out", "{t}/emptydir", *_S], "pass --overwrite"),
    # --out a file, under a file, in a read-only directory: one line before any work
    ("shard-out-file", ["shard", "--data", "{t}/mydir", "--out", "{t}/afile", "--overwrite", *_S], "is a file, not a directory"),
    ("shard-under-file", ["shard", "--data", "{t}/mydir", "--out", "{t}/afile/s", *_S], "lies under {t}/afile, which is a file"),
    ("shard-read-only", ["shard", "--data", "{t}/mydir", "--out", "{t}/ro/s", *_S], "{t}/ro is not writable"),
    ("train-out-file", ["train", "--shards", "{shards}", "--out", "{t}/afile", *_T], "is a file, not a directory"),
    ("train-under-file", ["train", "--shards", "{shards}", "--out", "{t}/afile/r", *_T], "which is a file"),
    ("train-read-only", ["train", "--shards", "{shards}", "--out", "{t}/ro/r", *_T], "{t}/ro is not writable"),
    ("eval-out-dir", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/emptydir", "--quiet"],
     "is a directory; give a file name, e.g. {t}/emptydir/report.json"),
    ("eval-under-file", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/afile/r.json", "--quiet"], "which is a file"),
    ("eval-read-only", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/ro/r.json", "--quiet"], "is not writable"),
    ("eval-not-json", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/rep.txt", "--quiet"], "ending in .json"),
    ("eval-over-run-json", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{run}/run.json", "--quiet"],
     "already exists and dipaco did not write it"),
    ("eval-over-users-md", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/rep.json", "--quiet"],
     "would overwrite {t}/rep.md, which dipaco did not write"),
    ("export-out-file", ["export", "--run", "{run}", "--path", "0-0", "--out", "{t}/afile", "--quiet"], "is a file, not a directory"),
    ("export-under-file", ["export", "--run", "{run}", "--path", "0-0", "--out", "{t}/afile/x", "--quiet"], "which is a file"),
    ("export-read-only", ["export", "--run", "{run}", "--path", "0-0", "--out", "{t}/ro/x", "--quiet"], "is not writable"),
    ("inspect-png-jsonl", ["inspect", "{shards}", "--png", "{t}/x.jsonl"], "the plot is a PNG; give a file name ending in .png"),
    ("inspect-under-file", ["inspect", "{shards}", "--png", "{t}/afile/p.png"], "which is a file"),
    ("inspect-read-only", ["inspect", "{shards}", "--png", "{t}/ro/p.png"], "is not writable"),
    ("inspect-users-png", ["inspect", "{shards}", "--png", "{t}/user.png"], "already exists and dipaco did not write it"),
    ("quickstart-out-file", ["quickstart", "--out", "{t}/afile", "--quiet"], "is a file, not a directory"),
    ("quickstart-under-file", ["quickstart", "--out", "{t}/afile/q", "--quiet"], "which is a file"),
    ("quickstart-read-only", ["quickstart", "--out", "{t}/ro/q", "--quiet"], "is not writable"),
    ("generate-binary-prompts", ["generate", "--run", "{run}", "--prompts-file", "{t}/bin.txt", "--quiet"],
     "looks binary (NUL bytes), not text"),
    ("generate-latin1-prompts", ["generate", "--run", "{run}", "--prompts-file", "{t}/latin.txt", "--quiet"],
     "is not valid UTF-8 (line 1)"),
    # the unclear cases, each with one answer
    ("shard-grid-too-big", ["shard", "--data", "{t}/mydir", "--out", "{t}/s", "--grid", "100", "--tokenizer",
                            "{shards}/tokenizer", "--set", "routing.svd_dims=16", "--quiet"],
     "paths got no training documents"),
    ("shard-vocab-size", ["shard", "--data", "{t}/mydir", "--out", "{t}/s", "--vocab-size", "100", "--quiet"],
     "'tokenizer.vocab_size' must be >= 300"),
    ("shard-mistyped-local-path", ["shard", "--data", "mydir/typo", "--out", "{t}/s", *_S],
     "input mydir/typo does not exist (mydir exists here, so it is not tried as a hub dataset name)"),
    ("train-workers-0", ["train", "--shards", "{shards}", "--out", "{t}/r", "--workers", "0", *_T], "--workers must be >= 1, got 0"),
    ("eval-mixture-0", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/r.json", "--mixture", "0", "--quiet"],
     "a mixture needs K >= 2 paths"),
    ("eval-mixture-1", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/r.json", "--mixture", "1", "--quiet"],
     "a mixture needs K >= 2 paths"),
    ("eval-mixture-99", ["eval", "--run", "{run}", "--shards", "{shards}", "--out", "{t}/r.json", "--mixture", "99", "--quiet"],
     "has 4 paths; give K from 2 to 4"),
    ("generate-mixture-99", ["generate", "--run", "{run}", "--mixture", "99", "--quiet", "int main"], "has 4 paths; give K from 2 to 4"),
    ("quickstart-rounds-0", ["quickstart", "--out", "{t}/q", "--rounds", "0", "--quiet"], "'rounds' must be > 0"),
]


@pytest.mark.parametrize("argv,needle", [c[1:] for c in _OUTPUT_CASES], ids=[c[0] for c in _OUTPUT_CASES])
def test_outputs_never_destroy_user_files(argv, needle, small_runs, shards_2x2, corpus_file, tmp_path, capsys, monkeypatch):
    import os

    _user_world(tmp_path, corpus_file)
    monkeypatch.chdir(tmp_path)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: not (Path(p) == tmp_path / "ro" and mode & os.W_OK)
                        and access(p, mode, *a, **k))
    names = {"t": tmp_path, "shards": shards_2x2, "run": small_runs / "dipaco"}
    before = _snapshot(tmp_path, shards_2x2, small_runs)
    command = argv[0]
    assert main([a.format(**names) for a in argv]) == 2
    err = _one_error_line(capsys, command)
    assert needle.format(**names) in err and "Traceback" not in err, err
    assert _snapshot(tmp_path, shards_2x2, small_runs) == before  # byte-identical, nothing added


def test_what_dipaco_wrote_is_reused_or_replaced(small_runs, shards_2x2, corpus_file, tmp_path, capsys, monkeypatch):
    """The other side of ownership: --resume into dipaco's run, --overwrite of its exports, eval over its own
    report and plots, an empty directory for train, and inspect --png DIR writing inside DIR."""
    import shutil

    from dipaco.eval.report import beside
    from dipaco.storage.outputs import check_out_dir, check_out_file

    _user_world(tmp_path, corpus_file)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(small_runs / "dipaco", run)
    assert main(["train", "--shards", str(shards_2x2), "--out", str(run), "--resume", "--rounds", "2", "--inner-steps", "2",
                 "--quiet", *_sets()]) == 0
    assert (run / "checkpoints" / "round_2").is_dir()
    assert check_out_dir(tmp_path / "emptydir", "run") == tmp_path / "emptydir"  # train may start in an empty one
    assert main(["export", "--run", str(run), "--path", "0-0", "--out", str(tmp_path / "x"), "--quiet"]) == 0
    check_out_dir(tmp_path / "x", "export", overwrite=True)  # --overwrite may replace dipaco's export
    report = tmp_path / "r.json"
    assert main(["eval", "--run", str(run), "--shards", str(shards_2x2), "--out", str(report), "--no-oracle",
                 "--no-random", "--quiet"]) == 0
    check_out_file(report, "--out", beside(report))  # a second eval may replace its report, .md and plots
    plots = tmp_path / "plots"
    plots.mkdir()
    assert main(["inspect", str(shards_2x2), "--png", str(plots)]) == 0
    assert (plots / f"{shards_2x2.name}-paths.png").stat().st_size > 0
    assert f"wrote {plots / shards_2x2.name}-paths.png" in capsys.readouterr().out
    assert main(["inspect", str(shards_2x2), "--png", str(plots), "--json"]) == 0  # its own PNG: replaced
    assert not list(tmp_path.glob(".*"))  # no temporary or .old file


def test_shard_overwrite_replaces_its_own_and_counts_skipped_files(shards_2x2, corpus_file, tmp_path, capsys):
    _user_world(tmp_path, corpus_file)
    (tmp_path / "mydir" / "tool.bin").write_bytes(b"\x00\x01")
    (tmp_path / "mydir" / "README").write_text("not read: no known extension\n")
    out = tmp_path / "s"
    args = ["shard", "--data", str(tmp_path / "mydir"), "--out", str(out), "--grid", "2", "--tokenizer",
            str(shards_2x2 / "tokenizer"), "--set", "routing.svd_dims=16", "--quiet"]
    assert main(args) == 0
    assert main([*args, "--overwrite"]) == 0
    assert "skipped 2 files of unknown type in the --data directories" in capsys.readouterr().out
    skipped = json.loads((out / "manifest.json").read_text())["skipped_files"]
    assert skipped == {"count": 2, "examples": [str(tmp_path / "mydir" / "README"), str(tmp_path / "mydir" / "tool.bin")]}
    assert not list(tmp_path.glob(".*"))


def test_a_save_to_disk_directory_is_read_as_a_dataset(shards_2x2, corpus_file, tmp_path, capsys):
    import datasets

    rows = [json.loads(line) for line in corpus_file.read_text(encoding="utf-8").splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saveddict"))
    common = ["--grid", "2", "--tokenizer", str(shards_2x2 / "tokenizer"), "--set", "routing.svd_dims=16", "--quiet"]
    for name in ("saved", "saveddict"):
        assert main(["shard", "--data", str(tmp_path / name), "--out", str(tmp_path / f"s-{name}"), *common]) == 0
        m = json.loads((tmp_path / f"s-{name}" / "manifest.json").read_text())
        assert m["documents"] > 100 and m["inputs"][0]["saved_dataset"] and m["labels_per_path"]
    capsys.readouterr()
    assert main(["shard", "--data", str(tmp_path / "saveddict"), "--out", str(tmp_path / "s3"), "--split", "test", *common]) == 2
    assert "has no split 'test' (splits: train); pass --split" in _one_error_line(capsys, "shard")


def test_a_prompt_longer_than_the_model_keeps_its_last_tokens(small_runs, tmp_path, capsys):
    prompt = tmp_path / "long.txt"
    prompt.write_text("int main(void) { return 0; } " * 4000 + "\n")
    assert main(["generate", "--run", str(small_runs / "dipaco"), "--prompts-file", str(prompt), "--max-new-tokens", "5",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "# the prompt is longer than the model's 64 tokens: kept its last 59 tokens (" in err and "Traceback" not in err


def test_file_system_errors_become_one_line_and_leave_no_temporaries(shards_2x2, corpus_file, tmp_path, capsys, monkeypatch):
    """An OSError no check foresaw (disk full, a race): one line naming the path and the cause, exit 2, the
    temporary directory gone; a failed replace puts the old directory back and leaves no .old copy."""
    import os

    import dipaco.sharding.writer as writer
    from dipaco.io import atomic_write_text, commit_dir

    def full(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "s" / "tokenizer"))

    monkeypatch.setattr(writer, "load_tokenizer", full)
    assert main(["shard", "--data", str(corpus_file), "--out", str(tmp_path / "s"), "--grid", "2", "--tokenizer",
                 str(shards_2x2 / "tokenizer"), "--quiet"]) == 2
    err = _one_error_line(capsys, "shard")
    assert f"{tmp_path / 's' / 'tokenizer'}: No space left on device" in err
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()

    final, tmp = tmp_path / "final", tmp_path / ".final.tmp-1"
    final.mkdir()
    (final / "manifest.json").write_text(json.dumps({"format": "dipaco-shards"}))
    tmp.mkdir()
    replace, calls = os.replace, []

    def second_fails(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise OSError(5, "Input/output error", str(a))
        replace(a, b)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError):
        commit_dir(tmp, final)  # final -> .old passes, tmp -> final fails: .old goes back to final
    calls.clear()
    calls.append("the next call fails")
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "x.json", "{}")
    monkeypatch.undo()
    assert json.loads((final / "manifest.json").read_text()) == {"format": "dipaco-shards"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".final.tmp-1", "final"]
