"""Golden fixture: two small training runs whose per-round losses and weight summaries are checked in
(tests/golden/golden.json) and compared at tolerance.

Why this exists beside the equivalence tests: those compare one mode of the code against another mode of
the same code (2 workers against the world of one, a resumed run against a straight one, 4 bits on 2, 3, 4
workers). A change that moves every mode the same way passes all of them: apply the outer lr differently
(say ``θ ← θ − lr·(1−μ)·v`` instead of ``θ ← θ − lr·v``), average a module with other weights, drop the
Nesterov look-ahead, change the inner schedule, and the world of one and the workers still agree with each
other. Here the numbers themselves are pinned, as the code before the issue-13 refactor produced them
(commit 3e49c62): any of those changes fails. Measured on the world-of-one run: an outer lr 0.1% off
(0.6993 instead of 0.7) moves the module norms by 1.8e-4 relative, 18x the tolerance; momentum 0.899
instead of 0.9 by 1.3e-4; Nesterov off by 6e-2. Re-running the same code with 1 or 2 threads is bit-identical.

Runs (both 2 rounds of H = 4 on a 2x2 grid, tiny model, a synthetic corpus built here from a seeded RNG so
that the fixture does not depend on files of the machine):

- ``dipaco_2x2``: DiPaCo in the world of one, 32-bit outer gradients, with validation;
- ``streaming_4bit_2workers``: Streaming DiLoCo (2 fragments, τ = 1, α = 0.5) with 4-bit outer gradients on
  2 gloo workers under torchrun (``dipaco train --workers 2``).

What is pinned, per run: every trainee's mean training loss and every path's validation loss per round, and
for every module of rounds 0, 1 and 2 its L2 norm, its sum and its L1 norm (a sha256 of its bytes too, checked
only with DIPACO_GOLDEN_EXACT=1, which also demands the losses to the last bit: different CPUs and BLAS
kernels round differently, so bit-exact results are a same-machine property). Tolerance: 1e-5 relative for losses and norms; a sum is compared to within 1e-5
of the module's L1 norm (a sum of thousands of signed values can sit near zero). A 4-bit value that rounds
to the neighbouring level on another CPU moves one element by one step, which these summaries absorb.

The shards are a precondition, not the subject: their token files are digested first, and a different
digest (the tokenizer or the shard writer changed) fails with its own message.

Rewrite the fixture (only when a change of the numbers is intended, and say why in the commit):

    pytest tests/test_golden.py --rewrite-golden
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_TRAIN

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).resolve().parent / "golden" / "golden.json"
ROUNDS, H = 2, 4
RTOL = 1e-5
RUNS = {
    "dipaco_2x2": {"workers": 1, "sets": []},
    "streaming_4bit_2workers": {"workers": 2, "sets": ["streaming.fragments=2", "streaming.overlap=1",
                                                        "streaming.alpha=0.5", "comm.bits=4"]},
}


# ------------------------------------------------------------------------------------------- inputs
def synthetic_corpus(path: Path, docs_per_domain: int = 60, seed: int = 13) -> None:
    """Four 'domains' of pseudo-words from a seeded ``random.Random`` (the same bytes on every machine)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    common = ["the", "of", "and", "a", "to", "in", "is", "that", "for", "it"]
    domains = {d: ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(50)]
               for d in ("north", "south", "east", "west")}
    with open(path, "w", encoding="utf-8") as f:
        for i in range(docs_per_domain):
            for name, words in domains.items():
                n = rng.randint(80, 200)
                text = " ".join(rng.choice(words) if rng.random() < 0.7 else rng.choice(common) for _ in range(n))
                f.write(json.dumps({"text": f"{name} {i}: {text}.", "domain": name}) + "\n")


def shards_digest(shards: Path) -> str:
    """sha256 of every path's token files (train and val), in path order."""
    h = hashlib.sha256()
    for f in sorted((shards / "paths").glob("*/*.bin")):
        h.update(f"{f.parent.name}/{f.name}".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- runs
def _train(shards: Path, out: Path, workers: int, sets: list[str]) -> None:
    from dipaco.cli.commands import main

    args = ["train", "--shards", str(shards), "--out", str(out), "--quiet", "--rounds", str(ROUNDS),
            "--inner-steps", str(H)]
    if workers > 1:
        args += ["--workers", str(workers)]
    for kv in [*TINY_TRAIN, *sets]:
        args += ["--set", kv]
    assert main(args) == 0


def summarize(run: Path) -> dict:
    """What the fixture pins of a run directory (read from its files: the on-disk format, not the code)."""
    rounds = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "round"]
    out = {"train_loss_by_trainee": {str(r["round"]): r["train_loss_by_trainee"] for r in rounds},
           "val_loss": {str(r["round"]): r["val_loss"] for r in rounds}, "modules": {}, "sha256": {}}
    for r in range(ROUNDS + 1):
        files = sorted((run / "checkpoints" / f"round_{r}" / "modules").glob("*.safetensors"))
        assert files, f"{run}: no modules in round {r}"
        for f in files:
            tensors = load_file(f)
            flat = torch.cat([tensors[n].double().reshape(-1) for n in sorted(tensors)])
            out["modules"][f"{r}/{f.stem}"] = {"norm": flat.norm().item(), "sum": flat.sum().item(),
                                               "l1": flat.abs().sum().item()}
            h = hashlib.sha256()
            for n in sorted(tensors):
                h.update(n.encode())
                h.update(tensors[n].contiguous().view(torch.uint8).numpy().tobytes())
            out["sha256"][f"{r}/{f.stem}"] = h.hexdigest()
    return out


@pytest.fixture(scope="module")
def golden_inputs(tmp_path_factory):
    from dipaco.sharding.writer import shard

    from conftest import shard_config

    root = tmp_path_factory.mktemp("golden")
    corpus = root / "corpus.jsonl"
    synthetic_corpus(corpus)
    shards = root / "shards"
    shard([str(corpus)], shard_config("2x2", 'routing.assign="random"', "seed=0"), shards, progress=False)
    return root, shards


def _source() -> str:
    """The commit of the code that produced the numbers (and whether its tracked files were modified)."""
    import dipaco

    where = Path(dipaco.__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "diff", "--quiet", "HEAD", "--", "."]).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes" if dirty else "")


# ------------------------------------------------------------------------------------------- the test
def _close(a: float, b: float, scale: float | None = None) -> bool:
    return abs(a - b) <= RTOL * (abs(b) if scale is None else scale) + 1e-12


def compare(name: str, got: dict, want: dict) -> list[str]:
    """Every difference beyond tolerance, as readable lines (empty: the run matches)."""
    bad = []
    for key in ("train_loss_by_trainee", "val_loss"):
        if got[key].keys() != want[key].keys():
            bad.append(f"{name}: {key} rounds {sorted(got[key])} != {sorted(want[key])}")
            continue
        for r, w in want[key].items():
            g = got[key][r]
            pairs = zip(g, w) if isinstance(w, list) else ((g.get(k, math.nan), w[k]) for k in w)
            if len(g) != len(w) or not all(_close(x, y) for x, y in pairs):
                bad.append(f"{name}: round {r} {key} {g} != {w}")
    if got["modules"].keys() != want["modules"].keys():
        bad.append(f"{name}: modules {sorted(got['modules'])} != {sorted(want['modules'])}")
    for m, w in want["modules"].items():
        g = got["modules"].get(m)
        if g is None:
            continue
        if not (_close(g["norm"], w["norm"]) and _close(g["l1"], w["l1"]) and _close(g["sum"], w["sum"], w["l1"])):
            bad.append(f"{name}: module {m} norm/l1/sum {g['norm']:.9g}/{g['l1']:.9g}/{g['sum']:.9g} != "
                       f"{w['norm']:.9g}/{w['l1']:.9g}/{w['sum']:.9g}")
    if os.environ.get("DIPACO_GOLDEN_EXACT") == "1":
        bad += [f"{name}: module {m} not bit-identical" for m, d in want["sha256"].items() if got["sha256"].get(m) != d]
        bad += [f"{name}: {key} not identical" for key in ("train_loss_by_trainee", "val_loss") if got[key] != want[key]]
    return bad


def test_golden_runs(golden_inputs, request):
    root, shards = golden_inputs
    rewrite = request.config.getoption("--rewrite-golden")
    got = {"shards_sha256": shards_digest(shards), "runs": {}}
    if not rewrite:
        assert GOLDEN.is_file(), f"{GOLDEN} is missing; write it with: pytest tests/test_golden.py --rewrite-golden"
        want = json.loads(GOLDEN.read_text())
        assert got["shards_sha256"] == want["shards_sha256"], (
            "the golden shards differ from the fixture's (the tokenizer, the shard writer or the synthetic corpus "
            "changed), so the training numbers cannot be compared; if that change is intended, rewrite the fixture: "
            "pytest tests/test_golden.py --rewrite-golden")
    for name, spec in RUNS.items():
        out = root / name
        _train(shards, out, spec["workers"], spec["sets"])
        got["runs"][name] = summarize(out)
    if rewrite:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({
            "about": "tests/test_golden.py pins these numbers; rewrite: pytest tests/test_golden.py --rewrite-golden",
            "generated_by": {"code": _source(), "torch": torch.__version__, "machine": platform.machine(),
                             "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
            **got}, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"rewrote {GOLDEN}")
    bad = [line for name in RUNS for line in compare(name, got["runs"][name], want["runs"][name])]
    assert not bad, "the runs moved away from the golden fixture (tests/golden/golden.json):\n" + "\n".join(bad)
    same = all(got["runs"][n]["sha256"] == want["runs"][n]["sha256"] for n in RUNS)
    print(f"golden: within {RTOL:g}; weights bit-identical to the fixture: {same}")
