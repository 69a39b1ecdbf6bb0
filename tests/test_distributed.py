"""Multi-process engine: gloo workers on 127.0.0.1 (via `dipaco train --workers N`) against the world of one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.storage import checkpoint
from dipaco.storage.run import Run
from dipaco.training.comm import LocalWorld, analytic_bytes, make_world
from dipaco.training.launch import free_port, rank_argv, torchrun_command
from dipaco.training.plan import assign
from dipaco.training.quant import payload_bytes
from dipaco.training.train import train

from conftest import TINY_TRAIN, tiny_train_config

ROUNDS, H = 2, 4
STREAM_ROUNDS = 4  # the streaming runs are long enough to kill one mid-run (test_torchrun_restart_...)
STREAMING = ["streaming.fragments=2", "streaming.overlap=1", "streaming.alpha=0.5"]


def test_each_rank_runs_the_command_without_the_launchers_flags():
    argv = ["train", "--workers", "2", "--shards", "s", "--max-restarts=3", "--out", "o", "--set", "rounds=2", "--quiet"]
    assert rank_argv(argv) == ["train", "--shards", "s", "--out", "o", "--set", "rounds=2", "--quiet"]
    assert rank_argv(["train", "--max-restarts", "1", "--workers=4", "--out", "o"]) == ["train", "--out", "o"]


def _worker_args(shards, out, workers, rounds, *sets):
    """`dipaco train` arguments; ``workers=None``: none of its own (a torchrun started elsewhere)."""
    args = ["train", "--shards", str(shards), "--out", str(out), "--quiet", "--rounds", str(rounds),
            "--inner-steps", str(H)] + (["--workers", str(workers)] if workers else [])
    for kv in [*TINY_TRAIN, "val_batches=0", *sets]:
        args += ["--set", kv]
    return args


def _run_workers(shards, out, workers, *sets, rounds=ROUNDS):
    assert main(_worker_args(shards, out, workers, rounds, *sets)) == 0


@pytest.fixture(scope="module")
def two_streaming(shards_2x2, tmp_path_factory):
    """An uninterrupted 2-worker Streaming DiLoCo run (the reference of two tests)."""
    out = tmp_path_factory.mktemp("two") / "two"
    _run_workers(shards_2x2, out, 2, *STREAMING, rounds=STREAM_ROUNDS)
    return out


def _reports(out):
    return [json.loads(p.read_text()) for p in sorted((out / "workers").glob("rank_*.json"))]


def _assert_close(a_run, b_run, atol, rounds=ROUNDS):
    a, b = checkpoint.load_modules(a_run, rounds), checkpoint.load_modules(b_run, rounds)
    assert a.keys() == b.keys()
    worst = max((a[m][n] - b[m][n]).abs().max().item() for m in a for n in a[m])
    assert worst <= atol, worst


def _assert_holders_identical_and_alone(out, numel_of, bits, syncs_per_fragment):
    reports = _reports(out)
    holders = {}
    for rep in reports:
        for m in rep["modules"]:
            holders.setdefault(m, []).append(rep["rank"])
    run = Run(out)
    trainees = run.info["trainees"]  # [{path, worker, ...}]: how many of a module's trainees each holder has
    for m, ranks in holders.items():
        digests = {rep["modules"][m] for rep in reports if rep["rank"] in ranks}
        assert len(digests) == 1, m  # shared modules end bit-identical on all holders
        counts = [sum(t["worker"] == r and m in run.grid.path_modules(t["path"]) for t in trainees) for r in ranks]
        for rep in reports:
            got = rep["module_bytes"].get(m, [0, 0])
            if rep["rank"] not in ranks or len(ranks) == 1:
                assert got == [0, 0], (m, rep["rank"])  # only holders exchange a module
            else:
                per = [analytic_bytes(k, counts, bits, 128)[ranks.index(rep["rank"])] for k in numel_of(m)]
                want = [sum(s for s, _ in per) * syncs_per_fragment, sum(r for _, r in per) * syncs_per_fragment]
                assert got == want, (m, rep["rank"])
    return holders


def _numels(run, fragments=1):
    from dipaco.training.streaming import split_fragments

    modules = checkpoint.load_modules(run, 0)
    num_layers = Run(run).config.model.num_layers

    def numel_of(m):
        groups = split_fragments(list(modules[m]), num_layers, fragments)
        return [sum(modules[m][n].numel() for n in g) for g in groups if g]
    return numel_of


@pytest.fixture(scope="module")
def one_fp32(shards_2x2, tmp_path_factory):
    """The world of one at 32 bits: the reference of the multi-worker runs."""
    out = tmp_path_factory.mktemp("one") / "one"
    train(tiny_train_config("val_batches=0", rounds=ROUNDS, inner_steps=H), shards_2x2, out, progress=False)
    return out


@pytest.mark.slow
def test_three_workers_match_the_world_of_one(shards_2x2, one_fp32, tmp_path):
    one = one_fp32
    three = tmp_path / "three"
    _run_workers(shards_2x2, three, 3)
    _assert_close(one, three, atol=1e-5)
    holders = _assert_holders_identical_and_alone(three, _numels(three), 32, ROUNDS)
    # 4 trainees on 3 workers: 0-0, 0-1 on rank 0; 1-0 on rank 1; 1-1 on rank 2
    assert holders["L0.E0"] == [0] and holders["L0.E1"] == [1, 2] and holders["L1.E1"] == [0, 2]
    assert holders["embed"] == [0, 1, 2]
    rounds = [json.loads(l) for l in (three / "metrics.jsonl").read_text().splitlines() if '"round"' in l[:20]]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["bytes_sent"] > 0 and r["workers"] == 3 for r in rounds)
    assert all(k in rounds[0] for k in ("compute_s", "comm_s", "wait_s", "bytes_received"))
    assert json.loads((three / "run.json").read_text())["workers"] == 3


@pytest.mark.slow
def test_four_bits_is_the_same_maths_on_one_two_and_three_workers(shards_2x2, one_fp32, tmp_path):
    """--bits 4 is Q_down(Σ w_i·deq(Q_up(Δ_i))) whatever the layout: the world of one, 2 workers (2 trainees each:
    reduce-scatter for the shared modules, all-gather for pairs), 3 workers (2, 1, 1 trainees: a 3-holder
    reduce-scatter) and 4 workers (one trainee each: a 4-holder reduce-scatter) end with the same weights, and not
    with fp32's. With 4 holders of one trainee each a holder sends 2(n−1)/n·P per sync, not the all-gather's (n−1)·P."""
    one = tmp_path / "one4"
    train(tiny_train_config("val_batches=0", "comm.bits=4", rounds=ROUNDS, inner_steps=H), shards_2x2, one,
          progress=False)
    a = checkpoint.load_modules(one, ROUNDS)
    for workers in (2, 3, 4):
        run = tmp_path / f"w{workers}"
        _run_workers(shards_2x2, run, workers, "comm.bits=4")
        b = checkpoint.load_modules(run, ROUNDS)
        worst = max((a[m][n] - b[m][n]).abs().max().item() for m in a for n in a[m])
        print(f"--bits 4: world of one vs {workers} workers, max weight difference {worst:.3g}")
        assert worst <= 1e-4, worst
        holders = _assert_holders_identical_and_alone(run, _numels(run), 4, ROUNDS)
        if workers == 4:
            assert holders["embed"] == [0, 1, 2, 3]
            (numel,) = _numels(run)("embed")
            sent = _reports(run)[0]["module_bytes"]["embed"][0] / ROUNDS
            p, allgather = payload_bytes(numel, 4, 128), analytic_bytes(numel, [1] * 4, 4, 128, "allgather")[0][0]
            print(f"4 holders, 4 bits, embed: {sent:.0f} bytes sent per holder per sync = {sent / p:.4f} P "
                  f"(all-gather: {allgather / p:.0f} P)")
            assert abs(sent - 1.5 * p) <= 2 * 128 and allgather == 3 * p
    fp32 = checkpoint.load_modules(one_fp32, ROUNDS)
    gap = max((a[m][n] - fp32[m][n]).abs().max().item() for m in a for n in a[m])
    print(f"world of one, --bits 4 vs --bits 32: max weight difference {gap:.3g}")
    assert gap > 5e-4, gap  # 5x the tolerance above: the world of one does not skip the 4-bit transport


@pytest.mark.slow
def test_two_workers_streaming_match_the_world_of_one(shards_2x2, two_streaming, tmp_path):
    one = tmp_path / "one"
    train(tiny_train_config("val_batches=0", *STREAMING, rounds=STREAM_ROUNDS, inner_steps=H), shards_2x2, one,
          progress=False)
    _assert_close(one, two_streaming, atol=1e-5, rounds=STREAM_ROUNDS)
    _assert_holders_identical_and_alone(two_streaming, _numels(two_streaming, 2), 32, STREAM_ROUNDS)
    # 4-bit transport: byte counts and holder identity are checked on DistWorld directly (test_quant.py)


def test_worker_plan_and_errors(monkeypatch):
    assert assign(4, 3) == [0, 0, 1, 2] and assign(4, 4) == [0, 1, 2, 3] and assign(5, 2) == [0, 0, 0, 1, 1]
    with pytest.raises(DipacoError, match="at most 4 workers"):
        assign(4, 5)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(make_world(tiny_train_config(), "cpu"), LocalWorld)  # no launcher: a world of one
    cmd = torchrun_command(3, ["train", "--out", "x"], port=12345)
    assert "--nproc-per-node" in cmd and "127.0.0.1:12345" in cmd and cmd[-3:] == ["train", "--out", "x"]


@pytest.mark.slow
def test_init_from_a_dense_run(shards_2x2, tmp_path):
    dense = tmp_path / "dense"
    train(tiny_train_config("val_batches=0", 'grid.shape="1"', rounds=1, inner_steps=2), shards_2x2, dense, progress=False)
    run = tmp_path / "from_dense"
    train(tiny_train_config("val_batches=0", f'init_from="{dense}"', rounds=1, inner_steps=2), shards_2x2, run,
          progress=False)
    base = checkpoint.load_modules(dense, 1)["L0.E0"]
    for m in ("L0.E0", "L0.E1"):
        start = checkpoint.load_modules(run, 0)[m]
        assert all(torch.equal(start[n], base[n]) for n in start)
    with pytest.raises(DipacoError, match="not a dense model"):
        train(tiny_train_config(f'init_from="{run}"', rounds=1, inner_steps=2), shards_2x2, tmp_path / "x", progress=False)
    with pytest.raises(DipacoError, match="neither a dipaco run"):
        train(tiny_train_config(f'init_from="{tmp_path}"', rounds=1, inner_steps=2), shards_2x2, tmp_path / "y",
              progress=False)


@pytest.mark.slow
def test_two_nodes_equal_one_node(shards_2x2, two_streaming, tmp_path):
    """The multi-node path: two torchrun agents (`--nnodes 2`, `--node-rank 0` and `1`, one worker each, a static
    rendezvous on 127.0.0.1) run the same job as `dipaco train --workers 2` on one node (Streaming DiLoCo) and end
    with the same weights bit for bit, the same losses and the same per-rank reports."""
    run, port = tmp_path / "two_nodes", free_port()
    argv = _worker_args(shards_2x2, run, None, STREAM_ROUNDS, *STREAMING)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                "--local-addr", "127.0.0.1", "-m", "dipaco.cli", *argv],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}) for n in (0, 1)]
    try:
        outputs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)  # never leave a hung agent behind
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(err[-2000:] for _, err in outputs)
    a, b = checkpoint.load_modules(two_streaming, STREAM_ROUNDS), checkpoint.load_modules(run, STREAM_ROUNDS)
    assert a.keys() == b.keys()
    for m in a:
        for n in a[m]:
            assert torch.equal(a[m][n], b[m][n]), (m, n)

    def rounds(out):  # bytes in total: a reduction in flight is counted in the round it ends in (timing)
        lines = [l for l in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if l["kind"] == "round"]
        return [(l["round"], l["workers"], l["train_loss_by_trainee"]) for l in lines], sum(l["bytes_sent"] for l in lines)
    assert rounds(run) == rounds(two_streaming)
    assert [(r["rank"], r["trainees"], r["modules"]) for r in _reports(run)] == \
        [(r["rank"], r["trainees"], r["modules"]) for r in _reports(two_streaming)]


# ------------------------------------------------------------------------- torchrun restart
def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc/<pid>/task/*/children; Linux)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the process ended meanwhile
                continue
            found += kids
            todo += kids
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode("utf-8", "replace").split("\0") if "=" in kv)


def _latest(run) -> int:
    try:
        return checkpoint.latest_round(run) or 0
    except DipacoError:  # not there yet
        return 0


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_torchrun_restart_after_sigkill_resumes_bit_identically(shards_2x2, two_streaming, tmp_path):
    """`dipaco train --workers 2 --max-restarts 1`: SIGKILL rank 0 (the checkpoint writer) in the middle of
    round 2; torchrun restarts the group, the workers resume from round 1 and the job ends on its own with
    exit code 0 and the same weights, bit for bit, as the uninterrupted run (Streaming DiLoCo, so the local
    weights and the reductions in flight at a round boundary are restored too)."""
    run = tmp_path / "restarted"
    cmd = [sys.executable, "-m", "dipaco.cli", *_worker_args(shards_2x2, run, 2, STREAM_ROUNDS, *STREAMING),
           "--max-restarts", "1"]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while _latest(run) < 1 and proc.poll() is None and time.monotonic() - began < 240:
            time.sleep(0.02)
        assert _latest(run) == 1, f"round 1 never checkpointed: rc {proc.poll()}"
        workers = [p for p in _descendants(proc.pid) if _environ(p).get("RANK") == "0"
                   and _environ(p).get("TORCHELASTIC_RESTART_COUNT") == "0"]
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        killed_at = _latest(run)
        if killed_at >= STREAM_ROUNDS:  # a stalled machine let the whole run finish before the kill
            pytest.skip("the run finished before the worker could be killed")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # never leave a hung torchrun behind
            proc.wait()
    seconds = time.monotonic() - began
    assert proc.returncode == 0, err[-3000:]
    assert "exitcode: -9" in err, err[-3000:]  # torchrun saw the SIGKILL (and, given rc 0, restarted the group)
    assert checkpoint.list_rounds(run) == list(range(STREAM_ROUNDS + 1))
    assert not list((run / "checkpoints").glob(".round_*"))
    logged = [json.loads(l)["round"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"round"' in l[:20]]
    assert logged[-(STREAM_ROUNDS - 1):] == list(range(2, STREAM_ROUNDS + 1))  # rounds 2.. ran after the restart
    a, b = checkpoint.load_modules(two_streaming, STREAM_ROUNDS), checkpoint.load_modules(run, STREAM_ROUNDS)
    for m in a:
        for n in a[m]:
            assert torch.equal(a[m][n], b[m][n]), (m, n)
    print(f"restart test: {seconds:.1f} s, killed at round {killed_at}")
