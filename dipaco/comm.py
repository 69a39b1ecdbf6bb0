"""Communication between workers. The only file that imports torch.distributed.

Two worlds share one small interface (what ``dipaco.sync`` and ``dipaco.train`` use):

  ``start_reduce({module: {name: fp32 tensor}})`` -> handle; ``handle.wait()`` gives the same structure
      summed over the workers that hold each module (the transport may quantize it on the way)
  ``gather(obj)`` -> list of every rank's obj on rank 0 (None elsewhere); ``broadcast(obj)`` from rank 0
  ``stats()`` / ``reset_stats()``: bytes sent/received, communication and waiting seconds

``LocalWorld`` (no launcher): every trainee is in this process, reductions are the identity.
``DistWorld`` (torchrun): one process group per distinct set of holders, created once in the same
order on every rank, so a module's outer gradient goes only to the workers that hold it. Reductions
run on one background thread, in the order they were started (the same on every rank), so a
reduction overlaps with the inner steps that follow it until ``wait``.

Collective patterns for a group of n holders and a payload of P bytes per holder:
  allgather       every holder's quantized payload to every other, each sums all n in rank order;
                  sends and receives (n−1)·P per rank; one quantization
  reduce_scatter  the vector is cut into n chunks (P/n each); chunk j of every holder goes to holder j
                  (all-to-all), which sums in fp32, re-quantizes and all-gathers it; sends and receives
                  2(n−1)·P/n per rank; two quantizations
``auto`` takes allgather for n = 2 (equal bytes, one quantization fewer) and reduce_scatter for n >= 3.
Every rank ends with the same bytes and dequantizes them the same way: shared modules stay
bit-identical on all their holders.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dipaco.quant import dequantize, payload_bytes, quantize


class _Done:
    """A handle whose result is already there."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class LocalWorld:
    """All trainees in this process; reductions are the identity and move zero bytes."""

    rank = 0
    size = 1

    def __init__(self):
        self.module_bytes: dict[str, list[int]] = {}
        self.reset_stats()

    def setup(self, holders: dict[str, list[int]]) -> None:
        pass

    def start_reduce(self, grads: dict[str, dict[str, torch.Tensor]]):
        return _Done(grads)

    def gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj

    def reset_stats(self) -> None:
        self.bytes_sent = self.bytes_received = 0
        self.comm_seconds = self.wait_seconds = 0.0

    def stats(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "comm_s": self.comm_seconds, "wait_s": self.wait_seconds}

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def launched() -> bool:
    """True when this process runs under torchrun (or another env:// launcher) with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def chosen_pattern(pattern: str, n: int) -> str:
    if pattern != "auto":
        return pattern
    return "allgather" if n <= 2 else "reduce_scatter"


def analytic_bytes(numel: int, n: int, bits: int, block: int, pattern: str) -> int:
    """Bytes one holder sends (= receives) to reduce a vector of ``numel`` values among ``n`` holders."""
    if n <= 1:
        return 0
    if chosen_pattern(pattern, n) == "allgather":
        return (n - 1) * payload_bytes(numel, bits, block)
    chunk = _chunk_len(numel, n, bits, block)
    return 2 * (n - 1) * payload_bytes(chunk, bits, block)


def _chunk_len(numel: int, n: int, bits: int, block: int) -> int:
    """Values per reduce-scatter chunk: whole quantization blocks (any length for 16/32 bits)."""
    per = -(-numel // n)
    return per if bits >= 16 else -(-per // block) * block


class DistWorld:
    """Workers under torchrun. Create with ``DistWorld.init(device)``; call ``setup(holders)`` once."""

    def __init__(self, bits: int = 32, block: int = 128, pattern: str = "auto", mbit: float = 0.0,
                 latency_ms: float = 0.0, device: str = "cpu"):
        import torch.distributed as dist

        self.dist = dist
        self.bits, self.block, self.pattern = bits, block, pattern
        self.mbit, self.latency = mbit, latency_ms / 1000.0
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            # A PrefixStore named after the restart count: after a torchrun restart the launcher's store
            # still holds the previous attempt's keys, and gloo's connectFullMesh would read them.
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
            store = dist.TCPStore(host, port, size, is_master=(rank == 0 and not agent_store), wait_for_workers=False)
            prefix = f"dipaco/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            if self.device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.cpu_group = dist.new_group(backend="gloo")  # objects and checkpoints, never the comm thread's groups
        self.groups: dict[tuple[int, ...], object] = {}
        self.holders: dict[str, tuple[int, ...]] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dipaco-comm")
        self.module_bytes: dict[str, list[int]] = {}  # module -> [sent, received] over the whole run
        self.lock = threading.Lock()  # the communication thread updates the counters
        self.reset_stats()

    def setup(self, holders: dict[str, list[int]]) -> None:
        """One group per distinct holder set of two or more ranks, created in sorted order on every rank."""
        self.holders = {m: tuple(sorted(r)) for m, r in holders.items()}
        for ranks in sorted({r for r in self.holders.values() if len(r) > 1}):
            group = self.dist.new_group(list(ranks))
            if self.rank in ranks:
                self.groups[ranks] = group

    # ------------------------------------------------------------------------------ reductions
    def start_reduce(self, grads: dict[str, dict[str, torch.Tensor]]):
        future: Future = self.executor.submit(self._reduce_all, grads)
        return _Waiting(future, self)

    def _reduce_all(self, grads):
        began, sent, received = time.perf_counter(), 0, 0
        out = {}
        for m, tensors in grads.items():
            ranks = self.holders.get(m, (self.rank,))
            if len(ranks) == 1:
                out[m] = tensors
                continue
            names = list(tensors)
            flat = torch.cat([tensors[n].reshape(-1).float() for n in names])
            total, s, r = self._reduce_flat(flat, ranks)
            sent, received = sent + s, received + r
            counts = self.module_bytes.setdefault(m, [0, 0])
            counts[0], counts[1] = counts[0] + s, counts[1] + r
            out[m], offset = {}, 0
            for n in names:
                k = tensors[n].numel()
                out[m][n] = total[offset:offset + k].view_as(tensors[n]).to(tensors[n].dtype)
                offset += k
        self._simulate_link(began, sent, received, grads)
        with self.lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.comm_seconds += time.perf_counter() - began
        return out

    def _simulate_link(self, began: float, sent: int, received: int, grads) -> None:
        if not (self.mbit or self.latency):
            return
        messages = sum(len(self.holders.get(m, (0,))) - 1 for m in grads)
        target = (max(sent, received) * 8 / (self.mbit * 1e6) if self.mbit else 0.0) + self.latency * messages
        left = target - (time.perf_counter() - began)
        if left > 0:
            time.sleep(left)

    def _reduce_flat(self, flat: torch.Tensor, ranks: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
        dist, group, n = self.dist, self.groups[ranks], len(ranks)
        bits, block = self.bits, self.block
        flat = flat.to(self.device)
        if chosen_pattern(self.pattern, n) == "allgather":
            payload = quantize(flat, bits, block)
            bufs = [torch.empty_like(payload) for _ in range(n)]
            dist.all_gather(bufs, payload, group=group)
            total = torch.zeros_like(flat)
            for b in bufs:  # rank order: the same sum on every holder
                total += dequantize(b, flat.numel(), bits, block)
            return total, (n - 1) * payload.numel(), (n - 1) * payload.numel()
        chunk = _chunk_len(flat.numel(), n, bits, block)
        padded = torch.zeros(chunk * n, dtype=torch.float32, device=flat.device)
        padded[:flat.numel()] = flat
        pieces = [quantize(padded[j * chunk:(j + 1) * chunk], bits, block) for j in range(n)]
        size = pieces[0].numel()
        incoming = torch.empty(size * n, dtype=torch.uint8, device=flat.device)
        dist.all_to_all_single(incoming, torch.cat(pieces), group=group)
        mine = torch.zeros(chunk, dtype=torch.float32, device=flat.device)
        for j in range(n):
            mine += dequantize(incoming[j * size:(j + 1) * size], chunk, bits, block)
        requantized = quantize(mine, bits, block)
        bufs = [torch.empty_like(requantized) for _ in range(n)]
        dist.all_gather(bufs, requantized, group=group)
        total = torch.cat([dequantize(b, chunk, bits, block) for b in bufs])[:flat.numel()]
        return total, 2 * (n - 1) * size, 2 * (n - 1) * size

    # ------------------------------------------------------------------------------ objects
    def gather(self, obj) -> list | None:
        out = [None] * self.size if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def reset_stats(self) -> None:
        with self.lock:
            self.bytes_sent = self.bytes_received = 0
            self.comm_seconds = self.wait_seconds = 0.0

    def stats(self) -> dict:
        with self.lock:
            return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                    "comm_s": self.comm_seconds, "wait_s": self.wait_seconds}

    def barrier(self) -> None:
        self.dist.barrier(group=self.cpu_group)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _Waiting:
    """Handle of a reduction running on the communication thread; ``wait`` counts the time blocked."""

    def __init__(self, future: Future, world: DistWorld):
        self.future, self.world = future, world

    def wait(self):
        began = time.perf_counter()
        result = self.future.result()
        self.world.wait_seconds += time.perf_counter() - began
        return result


def make_world(cfg, device: str):
    """A DistWorld under a launcher, else the world of one."""
    if not launched():
        return LocalWorld()
    c = cfg.comm
    return DistWorld(c.bits, c.block_size, c.pattern, c.simulate_mbit, c.simulate_latency_ms, device)
