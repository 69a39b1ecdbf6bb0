"""A tiny trained run shared by the eval tests (trained once per session, on the session shards).

Every component is path-private, so each path is its own small model trained on its own shard:
paths then differ enough that routing must beat random routing (the shards are domain-clustered).
"""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_train_config

PRIVATE = ("grid.private_embedding=true", "grid.private_head=true", "grid.private_blocks=[0,1,2,3]",
           "inner.lr=3e-3", "eval.max_tokens_per_doc=256")
_RUNS: dict[tuple, Path] = {}


def trained_run(tmp_path_factory, shards: Path, *extra: str, rounds: int = 2, inner_steps: int = 8) -> Path:
    from dipaco.training.train import train

    key = (str(shards), extra, rounds, inner_steps)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp("evalrun") / "run"
        train(tiny_train_config(*extra, rounds=rounds, inner_steps=inner_steps), shards, out, progress=False)
        _RUNS[key] = out
    return _RUNS[key]


def private_run(tmp_path_factory, shards: Path) -> Path:
    return trained_run(tmp_path_factory, shards, *PRIVATE)
