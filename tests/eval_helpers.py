"""Tiny trained runs shared by the eval tests (trained once per session, on the session shards)."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_train_config

_RUNS: dict[tuple, Path] = {}


def trained_run(tmp_path_factory, shards: Path, *extra: str, rounds: int = 3, inner_steps: int = 12) -> Path:
    from dipaco.train import train

    key = (str(shards), extra, rounds, inner_steps)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp("evalrun") / "run"
        train(tiny_train_config(*extra, rounds=rounds, inner_steps=inner_steps), shards, out, progress=False)
        _RUNS[key] = out
    return _RUNS[key]
