"""The shard stage on every engine writes the same bytes (slow tier).

One small corpus built to stress the plan: a JSON-lines file cut into several byte ranges, a file of one
document, a parquet file of uneven row-group runs, and duplicates whose first copy sits in an earlier block;
``--balance`` and ``--overlap 2`` on. The reference is one process (``--num-proc 1``); then two local
processes, Ray on the session's two-node cluster, Ray with a worker SIGKILLed mid-block, a driver SIGKILLed
mid-pass and resumed, and the corpus read from a real S3-compatible server (moto) through fsspec.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import shard_config
from faults import fault_env

pytestmark = pytest.mark.slow

SETS = ["tokenizer.vocab_size=512", "routing.balance=1.2", "routing.svd_dims=16", "routing.overlap=2",
        "data.block_bytes=30000", "routing.kmeans_restarts=2", "routing.fit_sample=60"]  # a sample of 60 of ~180
IGNORED = ("created", "seconds", "timing", "threads", "execution")  # how long, on how many threads and workers


def digests(root: Path, same_inputs: bool = True) -> dict[str, str]:
    """sha256 of every file of a shard directory; the manifest without its run facts, config.toml without num_proc."""
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel, data = str(f.relative_to(root)), f.read_bytes()
        if rel == "manifest.json":
            m = json.loads(data)
            for k in IGNORED + (() if same_inputs else ("inputs",)):
                m.pop(k)
            m["config"].pop("num_proc")
            data = json.dumps(m, sort_keys=True).encode()
        elif rel == "config.toml":
            data = b"\n".join(line for line in data.splitlines() if not line.startswith(b"num_proc"))
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dipaco.sharding.sources import default_corpus_documents

    docs = default_corpus_documents(budget_per_kind=40_000, chunk=1500)
    root = tmp_path_factory.mktemp("engines") / "corpus"
    root.mkdir()
    rows = [{"text": d.text, "domain": d.label} for d in docs]
    big = rows[: len(rows) - 30]
    big = big + big[5:25:3] + big[60:70]  # copies whose first copy is several blocks back
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in big))
    (root / "b.jsonl").write_text(json.dumps(rows[-30]) + "\n")  # a block of one document
    tail = rows[-29:] + rows[:3]  # a copy of the corpus's first documents, in the last blocks
    pq.write_table(pa.Table.from_pylist(tail), root / "c.parquet", row_group_size=5)
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    from dipaco.sharding.writer import shard

    out = tmp_path_factory.mktemp("reference") / "s"
    m = shard([str(corpus)], shard_config("2x2", *SETS, "num_proc=1"), out, progress=False)
    assert m["execution"]["blocks"] >= 8 and m["dropped"]["duplicate"] >= 7 + 10 + 3
    assert m["execution"]["workers"] == 1 and m["assignment"]["overlap_copies"] > 0
    return out


def cli(corpus: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    sets = [a for kv in SETS for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "dipaco.cli", "shard", "--data", str(corpus), "--out", str(out), "--grid", "2x2",
           "--quiet", *sets, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def wait_for(f: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while not f.exists() or not f.read_text():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{f} never appeared"
        time.sleep(0.2)
    return int(f.read_text())


def test_the_sample_bound_drops_texts_but_no_bytes(corpus, reference, tmp_path, monkeypatch):
    """Blocks scanned after the running sample bound exists keep fewer texts; without the bound, the same shards."""
    from dipaco.sharding import scan
    from dipaco.sharding.writer import shard

    bounded = json.loads((reference / "manifest.json").read_text())["execution"]["scan_sample_texts"]
    monkeypatch.setattr(scan, "read_sample_bound", lambda work: None)
    m = shard([str(corpus)], shard_config("2x2", *SETS, "num_proc=1"), tmp_path / "s", progress=False)
    assert m["execution"]["scan_sample_texts"] > bounded + 30, (m["execution"]["scan_sample_texts"], bounded)
    assert digests(tmp_path / "s") == digests(reference)


def test_two_local_processes_write_the_same_bytes(corpus, reference, tmp_path):
    from dipaco.sharding.writer import shard

    m = shard([str(corpus)], shard_config("2x2", *SETS, "num_proc=2"), tmp_path / "s", progress=False)
    assert m["execution"]["workers"] == 2
    assert digests(tmp_path / "s") == digests(reference)


def test_ray_on_two_nodes_writes_the_same_bytes_through_a_lost_worker(corpus, reference, ray_cluster, tmp_path):
    # block 3's first attempt sleeps mid-block; its worker process is SIGKILLed; Ray retries it on a live worker
    out = tmp_path / "k"
    proc = cli(corpus, out, "--engine", "ray", "--address", ray_cluster.address, env=fault_env("block:3:60", tmp_path / "faults"))
    os.kill(wait_for(tmp_path / "faults" / "block-3.pid", proc), signal.SIGKILL)
    finish(proc)
    execution = json.loads((out / "manifest.json").read_text())["execution"]
    assert (execution["engine"], execution["workers"]) == ("ray", 2)
    assert digests(out) == digests(reference)


def test_a_killed_driver_resumes_to_the_same_bytes(corpus, reference, tmp_path):
    out, work = tmp_path / "s", tmp_path / ".s.work"
    proc = cli(corpus, out, "--num-proc", "1", env=fault_env("block:4:120", tmp_path / "faults"))
    assert wait_for(tmp_path / "faults" / "block-4.pid", proc) == proc.pid  # in-process: the driver sleeps mid-pass 2
    proc.kill()
    proc.wait()
    assert len(list((work / "parts").glob("0*"))) == 4 and not out.exists()
    other = cli(corpus, out, "--num-proc", "1", "--resume", "--seed", "5")  # not the same command: refused, work kept
    assert other.wait(timeout=120) == 2
    err = other.stderr.read().strip()
    assert "--resume:" in err and "rerun without --resume" in err and len(err.splitlines()) == 1
    finish(cli(corpus, out, "--num-proc", "2", "--resume"))
    m = json.loads((out / "manifest.json").read_text())
    assert m["execution"]["reused_parts"] == m["execution"]["blocks"] + 4  # every scan part and four of pass 2
    assert digests(out) == digests(reference) and not work.exists()


def test_an_s3_corpus_gives_the_same_bytes(corpus, reference, s3_server, tmp_path):
    bucket, client = s3_server.make_bucket(), s3_server.client()
    for f in sorted(corpus.iterdir()):
        client.upload_file(str(f), bucket, f"corpus/{f.name}")
    out = tmp_path / "s"
    finish(cli(f"s3://{bucket}/corpus/", out, "--num-proc", "2", env=s3_server.env))
    m = json.loads((out / "manifest.json").read_text())
    assert [i["path"] for i in m["inputs"]] == [f"s3://{bucket}/corpus/{n}" for n in ("a.jsonl", "b.jsonl", "c.parquet")]
    assert m["execution"]["blocks"] == json.loads((reference / "manifest.json").read_text())["execution"]["blocks"]
    assert digests(out, same_inputs=False) == digests(reference, same_inputs=False)


def test_a_pass_2_worker_imports_neither_torch_nor_transformers():
    """A worker's pass-2 modules load in seconds: the Rust tokenizer encodes, and torch is left to routers that
    compute with it (a model's features). Importing them took 5 s of each worker's start on this machine."""
    code = ("import sys, dipaco.sharding.parts, dipaco.sharding.scan; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_tfidf_driver_never_imports_torch(corpus, tmp_path):
    """The driver of a tf-idf shard run fits, routes and merges without torch: importing it cost a second of the
    fit step, on one core while the other idled (and about 170 MB of the driver's memory)."""
    code = ("import sys; from conftest import shard_config; from dipaco.sharding.writer import shard; "
            f"shard([{str(corpus)!r}], shard_config('2x2', *{SETS!r}, 'num_proc=1'), {str(tmp_path / 's')!r}, progress=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent).stdout
    assert out.strip().splitlines()[-1] == "False"
