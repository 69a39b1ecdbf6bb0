"""Fault injection for the tests, installed from outside the product: the test's processes load it through
``sitecustomize.py`` (this folder on PYTHONPATH), and it patches dipaco's functions as they are imported, so the
product holds no test hook and reads no test variable.

``DIPACO_FAULTS`` is a comma-separated list of delays:

  ``<trainee>:<version>:<seconds>[:<attempts>]``  attempt 1 (attempts 1 to ``attempts``) of phase (trainee, version)
                                                  sleeps before its middle inner step (the attempt's number as the
                                                  task store counts it; the in-process engine's one run is attempt 1)
  ``step:<version>:<seconds>``                    the first outer step from ``version`` (any group) sleeps after it
                                                  wrote its first module
  ``block:<index>:<seconds>``                     the first attempt of the shard stage's pass-2 block ``index``
                                                  sleeps after reading its first document

Each delay that fires writes its process id to ``$DIPACO_FAULTS_DIR/<name>.pid`` first (``phase-<trainee>-<version>-
<attempt>``, ``step-<version>``, ``block-<index>``), created only if absent: a delay fires once, and a retried step
or block finds that an attempt before it slept.
A test kills that process while it sleeps, or leaves the phase late. Ray workers of a cluster the test started
before the driver get the same variables through the driver's runtime environment (``runtime_env``, named by
``RAY_RUNTIME_ENV_HOOK``).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PASSED = ("DIPACO_FAULTS", "DIPACO_FAULTS_DIR")


def delays() -> list[tuple[str, int, float, int]]:
    """(target, version or block index, seconds, attempts) of every delay in ``DIPACO_FAULTS``."""
    out = []
    for item in filter(None, os.environ.get("DIPACO_FAULTS", "").split(",")):
        target, number, seconds, *upto = item.split(":")
        out.append((target, int(number), float(seconds), int(upto[0]) if upto else 1))
    return out


def claim(name: str) -> bool:
    """Create the marker ``name`` with this process's id; False when an earlier attempt created it."""
    marker = Path(os.environ["DIPACO_FAULTS_DIR"]) / f"{name}.pid"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


_attempt: dict[tuple[int, int | str], int] = {}  # (version, trainee or step group): this process's attempt of it


def phase_delay(trainee: int, step: int, inner_steps: int) -> float:
    """Seconds trainee ``trainee`` sleeps before inner step ``step`` (counted over its whole training)."""
    version, k = divmod(step, inner_steps)
    attempt = _attempt.get((version, trainee), 1)
    for target, v, seconds, attempts in delays():
        if target == str(trainee) and v == version and k == inner_steps // 2 and attempt <= attempts:
            if claim(f"phase-{trainee}-{v}-{attempt}"):  # once per attempt (a replay passes the same step again)
                return seconds
    return 0.0


def patch_trainee(module) -> None:
    inner_step = module.inner_step

    @functools.wraps(inner_step)
    def delayed_inner_step(tr, cfg, total_steps):
        if seconds := phase_delay(tr.index, tr.step, cfg.inner_steps):
            time.sleep(seconds)
        return inner_step(tr, cfg, total_steps)

    module.inner_step = delayed_inner_step


_step_delay = [0.0]  # armed by an outer step that takes a delay, spent by its first module write


def patch_phases(module) -> None:
    outer_step = module.outer_step

    @functools.wraps(outer_step)
    def delayed_outer_step(spec, *args, **kwargs):
        for target, v, seconds, _ in delays():
            if target == "step" and v == spec.version and claim(f"step-{v}"):
                _step_delay[0] = seconds
        return outer_step(spec, *args, **kwargs)

    module.outer_step = delayed_outer_step


def patch_taskstore(module) -> None:
    put, record_attempt = module.TaskStore.put, module.TaskStore.record_attempt

    @functools.wraps(record_attempt)
    def noted_record_attempt(self, v, who, *args, **kwargs):
        _attempt[(v, who)] = record_attempt(self, v, who, *args, **kwargs)
        return _attempt[(v, who)]

    @functools.wraps(put)
    def put_then_sleep(self, *args, **kwargs):
        entry = put(self, *args, **kwargs)
        if _step_delay[0]:
            seconds, _step_delay[0] = _step_delay[0], 0.0
            time.sleep(seconds)
        return entry

    module.TaskStore.put, module.TaskStore.record_attempt = put_then_sleep, noted_record_attempt


def patch_parts(module) -> None:
    block_rows = module.block_rows

    @functools.wraps(block_rows)
    def delayed_block_rows(block, *args, **kwargs):
        rows = block_rows(block, *args, **kwargs)
        for target, index, seconds, _ in delays():
            if target == "block" and index == block.index and claim(f"block-{index}"):
                first = next(rows, None)
                time.sleep(seconds)
                if first is not None:
                    yield first
        yield from rows

    module.block_rows = delayed_block_rows


# patched as each module finishes loading, before any other module binds the names it imports from it
PATCHES = {"dipaco.training.phase": patch_trainee, "dipaco.taskqueue.phases": patch_phases,
           "dipaco.taskqueue.taskstore": patch_taskstore, "dipaco.sharding.parts": patch_parts}


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of PATCHES through the other finders and patches each right after it runs."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is not self and (spec := getattr(finder, "find_spec", lambda *a: None)(name, path, target)):
                exec_module = spec.loader.exec_module

                def exec_and_patch(module):
                    exec_module(module)
                    PATCHES[name](module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def install() -> None:
    if not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport())


def runtime_env(env: dict | None) -> dict:
    """Ray's runtime-environment hook (``RAY_RUNTIME_ENV_HOOK``): the workers of a cluster started before the driver
    load these hooks too."""
    env = dict(env or {})
    entries = [str(HERE)] + [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e != str(HERE)]
    python_path = os.pathsep.join(entries)
    env["env_vars"] = {**env.get("env_vars", {}), "PYTHONPATH": python_path,
                       **{k: os.environ[k] for k in PASSED if k in os.environ}}
    return env
