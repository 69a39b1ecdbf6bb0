"""Shared fixtures: a small real corpus (text that ships with Python and the OS) and tiny shards; the test tiers.

Two tiers: unit tests (pure code and fakes, well under a minute: `pytest -m "not slow"`) and integration tests
marked `@pytest.mark.slow` (real shards and runs, gloo, torchrun, subprocesses, end to end). A test that asks
for the real corpus or its shards (`corpus_file`, `shards_2x2`, `tok`, directly or through another fixture)
is an integration test by definition: it is marked slow here even where its file forgot to.

The README's command runs the unit tier first, then the integration tier. Collected tests are ordered here: the
unit tier first, then the longest files (under `-n 2 --dist loadfile` no long file starts last on one worker;
the session's corpus and shards are then built once for both workers).
"""

from __future__ import annotations

import os

# Tiny models are dominated by per-op overhead; one intra-op thread per process is several times faster
# than two spinning threads, and multi-process tests would otherwise oversubscribe the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
from pathlib import Path

import pytest

from dipaco.config import TrainConfig, resolve
from dipaco.shard_config import ShardConfig

SHARED_CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"
TINY_TRAIN = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2", "model.num_kv_heads=2",
              "model.max_seq_len=64", "inner.batch_size=4", "inner.warmup_steps=5", "val_batches=1", "log_every=5"]


_REAL_DATA = {"corpus_file", "shards_2x2", "tok"}
# Files whose tests take minutes each: started first, so that none of them ends a run alone on one worker.
_LONGEST = ("test_ray_storage.py", "test_ray_keep_going.py", "test_ray_engine.py", "test_reproduce.py", "test_distributed.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _REAL_DATA & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    items.sort(key=_run_order)  # stable: a file's tests keep their order


def _run_order(item) -> tuple[bool, int]:
    """The unit tier first (plain `pytest` too fails fast on a broken unit), then the longest files, longest first."""
    slow = item.get_closest_marker("slow") is not None
    name = item.path.name
    return slow, _LONGEST.index(name) if slow and name in _LONGEST else len(_LONGEST)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(path)`` run once per test run: xdist's workers share the run's base folder, so the first to ask
    builds under a lock and the others read what it wrote (a session fixture alone would build once per worker)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            build(path)
            done.touch()
    return path


def pytest_addoption(parser):
    parser.addoption("--rewrite-golden", action="store_true",
                     help="tests/test_golden.py: rerun the golden runs and rewrite tests/golden/golden.json")


def tiny_train_config(*extra: str, rounds: int = 2, inner_steps: int = 10) -> TrainConfig:
    return resolve(TrainConfig, overrides=TINY_TRAIN + list(extra), flags={"rounds": rounds, "inner_steps": inner_steps})


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    from dipaco.sharding.sources import default_corpus_documents

    def write(folder: Path) -> None:
        folder.mkdir()
        with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
            for d in default_corpus_documents(budget_per_kind=150_000, chunk=3000):
                f.write(json.dumps({"text": d.text, "domain": d.label}) + "\n")

    return built_once(tmp_path_factory, "corpus", write) / "corpus.jsonl"


def shard_config(grid: str = "2x2", *extra: str) -> ShardConfig:
    return resolve(ShardConfig, overrides=[f'grid="{grid}"', "tokenizer.vocab_size=512", "routing.balance=1.2",
                                           "routing.svd_dims=16"] + list(extra))


@pytest.fixture(scope="session")
def shards_2x2(corpus_file, tmp_path_factory) -> Path:
    from dipaco.sharding.writer import shard

    return built_once(tmp_path_factory, "shards_2x2",
                      lambda out: shard([str(corpus_file)], shard_config("2x2"), out, progress=False))


@pytest.fixture(scope="session")
def tok(shards_2x2):
    """The tokenizer of the session's shards (routers read the decoded token prefix)."""
    from dipaco.storage.shards import ShardSet

    return ShardSet(shards_2x2).tokenizer()


@pytest.fixture(scope="session")
def s3_server():
    """One real S3-compatible server process (moto) per test session; see tests/s3server.py."""
    from s3server import start_s3_server

    server = start_s3_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local multi-node Ray cluster per test session: a head node and a worker node of 1 CPU each (two
    machines, as Ray sees them, on localhost). The train engine's and the shard stage's Ray tests share it."""
    pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def one_error_line(capsys, command: str) -> str:
    """stderr of a refused command: exactly one line, ``dipaco COMMAND: error: ...``."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dipaco {command}: error: "), err
    return err


def sets_of_tiny_train() -> list[str]:
    """TINY_TRAIN (without validation) as --set flags."""
    return [a for kv in [*TINY_TRAIN, "val_batches=0"] for a in ("--set", kv)]


@pytest.fixture(scope="module")
def small_runs(shards_2x2, tmp_path_factory):
    """A 2x2 run and a dense run of one round, without validation (tests that only read them)."""
    from dipaco.training.train import train

    root = tmp_path_factory.mktemp("runs")
    train(tiny_train_config("val_batches=0", rounds=1, inner_steps=2), shards_2x2, root / "dipaco", progress=False)
    train(tiny_train_config("val_batches=0", 'grid.shape="1"', rounds=1, inner_steps=2), shards_2x2, root / "dense",
          progress=False)
    return root
