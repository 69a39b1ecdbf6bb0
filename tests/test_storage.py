"""The storage interface, the run lease and the cluster connection's refusals (fast tier: local files, fsspec's memory
file system; the S3 server and Ray runs are in tests/test_ray_storage.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.storage.objects import Storage
from dipaco.taskqueue.lease import Lease


@pytest.mark.parametrize("root", ["local", "memory://dipaco-test-storage"])
def test_create_if_absent_is_won_once(tmp_path, root):
    s = Storage(str(tmp_path / "run") if root == "local" else f"{root}/{os.getpid()}-{time.time_ns()}")
    assert s.create_if_absent("queue/x/commit.json", b"first")
    assert not s.create_if_absent("queue/x/commit.json", b"second")
    assert s.read("queue/x/commit.json") == b"first"
    s.write("a/b.bin", b"12345")
    s.copy("a/b.bin", "c/d.bin")
    assert s.read("c/d.bin") == b"12345" and s.list("a") == ["b.bin"] and s.exists("c/d.bin")
    s.delete("a")
    assert not s.exists("a/b.bin") and s.list("a") == []
    assert s.counters()["storage_written"] == len(b"first") + 5 and s.counters()["storage_read"] >= 10


def test_two_processes_race_for_one_commit_and_one_wins(tmp_path):
    code = ("import sys; from dipaco.storage.objects import Storage; "
            "print(Storage(sys.argv[1]).create_if_absent('commit.json', sys.argv[2].encode()))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(k)], stdout=subprocess.PIPE, text=True)
             for k in range(6)]
    won = [p.communicate()[0].strip() == "True" for p in procs]
    assert sum(won) == 1 and (tmp_path / "commit.json").read_text() == str(won.index(True))


def test_a_missing_object_store_extra_is_one_line(monkeypatch):
    import fsspec

    def refuse(protocol, **kwargs):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "filesystem", refuse)
    with pytest.raises(DipacoError, match=r'pip install "dipaco\[s3\]"'):
        Storage("s3://bucket/run")


def test_a_second_driver_is_refused_naming_the_first(tmp_path):
    first = Lease(str(tmp_path)).acquire()
    try:
        with pytest.raises(DipacoError, match=rf"another driver \(host .*, pid {os.getpid()}"):
            Lease(str(tmp_path)).acquire()
    finally:
        first.release()
    assert not (tmp_path / "lease.json").exists()
    Lease(str(tmp_path)).acquire().release()  # free again


def test_a_dead_drivers_lease_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    body = {"owner": "gone", "host": __import__("socket").gethostname(), "pid": int(dead.stdout), "heartbeat": time.time()}
    (tmp_path / "lease.json").write_text(json.dumps(body))
    lease = Lease(str(tmp_path)).acquire()  # same machine, its process is gone: at once
    assert json.loads((tmp_path / "lease.json").read_text())["pid"] == os.getpid()
    lease.release()
    (tmp_path / "lease.json").write_text("garbage")  # a damaged lease holds nothing
    Lease(str(tmp_path)).acquire().release()


def test_an_unreachable_address_is_one_line_within_seconds(tmp_path, capsys):
    pytest.importorskip("ray")
    began = time.time()
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--engine", "ray",
               "--address", "127.0.0.1:1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and time.time() - began < 60
    assert len(err.splitlines()) == 1 and "127.0.0.1:1" in err and "ray start --head" in err, err


def test_keep_going_needs_an_address_and_resume_needs_a_run(tmp_path, capsys):
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--engine", "ray",
               "--keep-going"])
    assert rc == 2 and "--keep-going waits for a cluster at --address" in capsys.readouterr().err
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "nowhere"), "--resume"])
    assert rc == 2 and "holds no run" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", "s3://bucket/run"])
    assert rc == 2 and "add --engine ray" in capsys.readouterr().err


def test_shards_from_a_url_are_copied_once_per_machine(tmp_path, monkeypatch):
    from dipaco.taskqueue.runstore import local_shards

    monkeypatch.setenv("DIPACO_CACHE", str(tmp_path / "cache"))
    url = f"memory://dipaco-shards-{os.getpid()}-{time.time_ns()}/s2x2"
    s = Storage(url)
    s.write("manifest.json", b'{"format": "dipaco-shards"}')
    s.write("paths/0-0/train.bin", b"\x01\x02")
    local = local_shards(url)
    assert (local / "paths" / "0-0" / "train.bin").read_bytes() == b"\x01\x02" and (local / "manifest.json").is_file()
    s.write("paths/0-0/train.bin", b"changed")  # a whole copy is not fetched again
    assert local_shards(url) == local and (local / "paths" / "0-0" / "train.bin").read_bytes() == b"\x01\x02"
    assert local_shards(str(tmp_path)) == tmp_path


def test_a_bucket_prefix_holding_someone_elses_objects_is_refused(capsys):
    url = f"memory://dipaco-out-{os.getpid()}-{time.time_ns()}/prefix"
    Storage(url).write("notes.txt", b"mine")
    rc = main(["train", "--shards", "none", "--out", url, "--engine", "ray"])
    assert rc == 2 and "holds objects dipaco did not write (notes.txt)" in capsys.readouterr().err
    assert Storage(url).read("notes.txt") == b"mine"


def test_a_removed_latest_resumes_from_the_highest_complete_round_and_garbage_advises_no_loss(tmp_path):
    """Item 5: `checkpoints/latest` removed (as an earlier message advised) must not restart a run from round 0 over
    its rounds; a garbage one is refused with advice that keeps every round."""
    from dipaco.storage import checkpoint

    for r in (0, 1, 2, 3):
        (tmp_path / "checkpoints" / f"round_{r}" / "state").mkdir(parents=True)
        if r != 3:  # round 3: no meta.json, not complete
            (tmp_path / "checkpoints" / f"round_{r}" / "state" / "meta.json").write_text("{}")
    assert checkpoint.latest_round(tmp_path) == 2
    (tmp_path / "checkpoints" / "latest").write_text("\x00garbage")
    with pytest.raises(DipacoError) as exc:
        checkpoint.latest_round(tmp_path)
    assert "write round_2" in str(exc.value) and "remove it" not in str(exc.value) and "\n" not in str(exc.value)
