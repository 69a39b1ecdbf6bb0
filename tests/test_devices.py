"""Device rules (dipaco/training/devices.py) on the CPU: what a phase asks Ray for, where it trains, and the refusals;
and bench/gpu_check.py's line on a machine without a GPU. The GPU itself is exercised by bench/gpu_check.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dipaco.config import TrainConfig, resolve
from dipaco.errors import DipacoError
from dipaco.training.devices import deterministic, phase_device, phase_resources, resolve_device

ROOT = Path(__file__).resolve().parents[1]


def test_phase_device_follows_the_cluster():
    assert phase_device("cpu", cluster_gpus=8, gpus_per_phase=1) == "cpu"  # asked for the CPU: never a GPU
    assert phase_device("auto", cluster_gpus=0, gpus_per_phase=1) == "cpu"
    assert phase_device("auto", cluster_gpus=2, gpus_per_phase=1) == "cuda"
    assert phase_device("cuda", cluster_gpus=1, gpus_per_phase=0.25) == "cuda"


def test_cuda_on_a_cluster_without_gpus_is_refused_in_one_line():
    with pytest.raises(DipacoError) as e:
        phase_device("cuda", cluster_gpus=0, gpus_per_phase=1)
    msg = str(e.value)
    assert "\n" not in msg and "no GPU" in msg and "--device cpu" in msg
    with pytest.raises(DipacoError, match="gpus_per_phase=2 .* has 1"):
        phase_device("cuda", cluster_gpus=1, gpus_per_phase=2)


def test_phase_resources():
    assert phase_resources("cpu", threads=2, gpus_per_phase=1) == {"num_cpus": 2}
    assert phase_resources("cuda", threads=1, gpus_per_phase=0.5) == {"num_cpus": 1, "num_gpus": 0.5}


def test_gpus_per_phase_is_checked():
    assert resolve(TrainConfig, overrides=["ray.gpus_per_phase=0.5"]).ray.gpus_per_phase == 0.5
    with pytest.raises(DipacoError, match="gpus_per_phase"):
        resolve(TrainConfig, overrides=["ray.gpus_per_phase=0"])


def test_cuda_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DipacoError, match="CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_deterministic_leaves_the_cpu_alone():
    before = torch.are_deterministic_algorithms_enabled()
    deterministic("cpu")
    assert torch.are_deterministic_algorithms_enabled() == before


def test_gpu_check_says_it_skipped_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench/gpu_check.py measures instead of skipping")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path / "o"),
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("gpu_check: skipped: no CUDA device") and len(out.stdout.splitlines()) == 1
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "o").exists()  # nothing measured, nothing written


@pytest.mark.slow
def test_ray_phases_on_cuda_without_a_gpu_in_the_cluster_are_refused_in_one_line(shards_2x2, ray_cluster, tmp_path):
    """The phases' device is decided on the cluster, not on the driver: this CPU cluster has no GPU, so
    --device cuda stops before any phase, with one line, and writes no run."""
    from conftest import TINY_TRAIN

    out = tmp_path / "run"
    sets = [a for kv in TINY_TRAIN for a in ("--set", kv)]
    done = subprocess.run([sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards_2x2), "--out", str(out),
                           "--rounds", "1", "--inner-steps", "2", "--engine", "ray", "--address", ray_cluster.address,
                           "--device", "cuda", "--quiet", *sets], capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    # (the test cluster runs without token authentication: the driver warns about that once, on its own line)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "warning:" not in line]
    assert len(lines) == 1 and "the Ray cluster has no GPU" in lines[0] and "--device cpu" in lines[0], done.stderr
    assert not (out / "checkpoints").exists()
