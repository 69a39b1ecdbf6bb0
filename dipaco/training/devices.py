"""Where training computes, and what it asks a cluster for: one home for the device rules every engine follows.

  ``resolve_device``     the in-process and torchrun engines: this machine's device for ``--device``
  ``phase_device``       the Ray engine: the device its phases train on, decided from the cluster's resources
                         (``--device cuda`` on a cluster without a GPU is refused in one line, never a CPU run)
  ``phase_resources``    what one phase asks Ray for: its threads as CPUs, and ``ray.gpus_per_phase`` GPUs on cuda
  ``deterministic``      kernels that give the same bits every time on a GPU, so a retried phase writes the bytes
                         the lost attempt would have written (and the two engines agree)

Only the inner steps run on the GPU (bf16 autocast over fp32 master weights); outer gradients leave the phase as
fp32 (or the comm.bits payload) and the outer step runs in fp32.
"""

from __future__ import annotations

import os

import torch

from dipaco.errors import DipacoError

# cuBLAS picks reduction orders per workspace; a fixed workspace makes its GEMMs reproducible (read when the
# cuBLAS handle is created, so it must be set before the first matrix multiply on the device).
_CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(name: str) -> torch.device:
    """This process's device for ``--device`` (``auto``: cuda when available; cuda: LOCAL_RANK's GPU under torchrun)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise DipacoError("device 'cuda' requested but CUDA is not available; use --device cpu or auto")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def phase_device(name: str, cluster_gpus: float, gpus_per_phase: float) -> str:
    """The device of every phase of a Ray run: ``cuda`` asks for GPUs and needs a cluster that has them (at least
    ``gpus_per_phase`` on the cluster); ``auto`` is cuda when the cluster has a GPU; ``cpu`` never asks for one."""
    if name == "cpu" or (name == "auto" and cluster_gpus <= 0):
        return "cpu"
    if cluster_gpus <= 0:
        raise DipacoError("--device cuda: the Ray cluster has no GPU; start its nodes with GPUs "
                          "(`ray start --num-gpus N ...`) or train the phases on CPUs with --device cpu")
    if cluster_gpus < gpus_per_phase:
        raise DipacoError(f"--device cuda: a phase asks for ray.gpus_per_phase={gpus_per_phase:g} GPUs but the "
                          f"cluster has {cluster_gpus:g}; lower it (--set ray.gpus_per_phase=1) or add GPU nodes")
    return "cuda"


def phase_resources(device: str, threads: int, gpus_per_phase: float) -> dict:
    """Ray resources of one phase (or validation task): ``threads`` CPUs, plus its GPU share on cuda (a fraction
    packs several phases on one GPU; Ray then shares the card, not the memory bound)."""
    resources = {"num_cpus": threads}
    if device == "cuda":
        resources["num_gpus"] = gpus_per_phase
    return resources


def deterministic(device: torch.device | str) -> None:
    """Same inputs, same bits on ``device``: deterministic CUDA kernels (an op without one raises rather than
    drifts), no TF32 (fp32 matmuls stay fp32: the master weights and outer state), no autotuned cuDNN choice.
    On the CPU the kernels already are; the thread count is pinned by the caller (``threads``)."""
    if torch.device(device).type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
