"""Outputs never destroy what dipaco did not write (slow tier, real commands on real shards and runs).

Every case runs in a directory of the user's own things; a refused command exits 2 with one line and leaves every
file byte-identical, with nothing added; what dipaco wrote itself is reused or replaced as each command says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dipaco.cli.commands import main

from conftest import one_error_line, sets_of_tiny_train

_PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"  # a binary file among the user's things


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
    ("train-num-proc-0", ["train", "--shards", "{shards}", "--out", "{t}/r", "--num-proc", "0", *_T],
     "--num-proc must be >= 1, got 0"),
    ("train-num-proc-torchrun", ["train", "--shards", "{shards}", "--out", "{t}/r", "--num-proc", "2", "--workers", "2",
                                  *_T], "--num-proc sets the local engine's worker processes; with --workers (torchrun) drop it"),
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
    err = one_error_line(capsys, command)
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
                 "--quiet", *sets_of_tiny_train()]) == 0
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
    assert "has no split 'test' (splits: train); pass --split" in one_error_line(capsys, "shard")


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
    err = one_error_line(capsys, "shard")
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
