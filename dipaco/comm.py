"""Communication between workers. The only file that imports torch.distributed.

Two worlds share one small interface (what ``dipaco.sync`` and ``dipaco.train`` use):

  ``setup(holders)``  once: ``{module: {trainee index: rank}}`` for every trainee whose path holds the module
  ``start_reduce(deltas, weights)`` -> handle; ``handle.wait()`` gives ``{module: {name: Δ_m}}``, the module
      (or fragment) outer gradient ``Δ_m = Σ_i w_i·T(Δ_i)`` over all the module's trainees, the same bits on
      every holder. ``deltas``: ``{module: {trainee: {name: Δ_i}}}`` for this worker's trainees (fp32);
      ``weights``: ``{module: {trainee: w_i}}`` for all of the module's trainees, on every worker.
  ``gather(obj)`` -> list of every rank's obj on rank 0 (None elsewhere); ``broadcast(obj)`` from rank 0
  ``stats()`` / ``reset_stats()``: bytes sent/received, communication and waiting seconds

Transport T (``comm.bits``), defined per trainee so that a config computes the same thing on any layout:
  bits < 32   each trainee's Δ_i (the module's or fragment's tensors flattened in a fixed name order) is
              quantized once, as if sent from its own worker; every holder dequantizes every trainee's
              payload and sums ``w_i·deq(Q(Δ_i))`` in fp32 in trainee-index order (``weighted_sum``).
              A worker with several trainees sends each one's payload; a module held by one worker, and the
              world of one, do the quantize -> dequantize round trip locally and move zero bytes. Same
              numbers, same order: 1 or N workers give bit-identical outer gradients.
  bits = 32   exact: T is the identity, so a worker may send the fp32 partial sum of its own trainees and
              the holders add the partial sums (equal to the world of one up to fp32 reassociation).

``LocalWorld`` (no launcher): every trainee is in this process; nothing crosses a wire.
``DistWorld`` (torchrun): one process group per distinct set of holders, created once in the same
order on every rank, so a module's outer gradient goes only to the workers that hold it. Reductions
run on one background thread, in the order they were started (the same on every rank), so a
reduction overlaps with the inner steps that follow it until ``wait``.

Collective patterns for a group of n holders, a payload of P bytes per trainee (or partial sum), and
k_j trainees of the module on holder j:
  allgather       every holder's payloads go to every other holder (an all-gather; an all-to-all with
                  split sizes when the k_j differ, so nothing is padded): holder j sends (n−1)·k_j·P and
                  receives (Σk − k_j)·P. bits = 32 sends one partial sum (k_j counts as 1).
  reduce_scatter  bits = 32 only: the partial sum is cut into n chunks; chunk j of every holder goes to
                  holder j (all-to-all), which adds them and all-gathers the result; 2(n−1)·P/n per rank.
                  With fewer bits it would re-quantize partial sums (maths that changes with n): refused.
``auto`` takes allgather whenever bits < 32 and, at 32 bits, allgather for n = 2 and reduce_scatter
from n = 3 (fewer bytes). Every holder ends with the same bytes, dequantizes them the same way and
adds them in the same order: shared modules stay bit-identical on all their holders.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dipaco.errors import DipacoError
from dipaco.outer import weighted_sum
from dipaco.quant import dequantize, payload_bytes, quantize


def flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One fp32 vector of a module's (or fragment's) tensors, in the dict's name order (the same on every worker)."""
    return torch.cat([t.reshape(-1).float() for t in tensors.values()])


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``flatten``'s inverse: tensors shaped like ``like``'s, each with its own storage (a pending reduction
    saved with a checkpoint then carries only its own values)."""
    out, offset = {}, 0
    for n, t in like.items():
        out[n] = flat[offset:offset + t.numel()].view_as(t).clone()
        offset += t.numel()
    return out


def round_trip(flat: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """What a receiver reconstructs from ``flat`` sent at ``bits`` (fp32: the vector itself)."""
    return flat if bits == 32 else dequantize(quantize(flat, bits, block), flat.numel(), bits, block)


class _Done:
    """A handle whose result is already there."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class LocalWorld:
    """All trainees in this process: the quantize -> dequantize round trip happens here, zero bytes move."""

    rank = 0
    size = 1

    def __init__(self, bits: int = 32, block: int = 128):
        self.bits, self.block = bits, block
        self.module_bytes: dict[str, list[int]] = {}
        self.reset_stats()

    def setup(self, holders: dict[str, dict[int, int]]) -> None:
        pass

    def start_reduce(self, deltas: dict[str, dict[int, dict[str, torch.Tensor]]], weights: dict[str, dict[int, float]]):
        out = {}
        for m, by_trainee in deltas.items():
            vectors = {i: round_trip(flatten(d), self.bits, self.block) for i, d in by_trainee.items()}
            out[m] = unflatten(weighted_sum(vectors, weights[m]), next(iter(by_trainee.values())))
        return _Done(out)

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


def pattern_error(bits: int, pattern: str) -> str | None:
    """Why a (bits, pattern) pair is refused, as a one-line config message; None when it is fine."""
    if pattern == "reduce_scatter" and bits < 32:
        return (f"config: comm.pattern='reduce_scatter' re-quantizes partial sums, so with comm.bits={bits} the result "
                f"would change with the number of workers; use comm.pattern='auto' (or 'allgather'), or comm.bits=32")
    return None


def chosen_pattern(pattern: str, n: int, bits: int) -> str:
    if pattern != "auto":
        return pattern
    return "allgather" if bits < 32 or n <= 2 else "reduce_scatter"


def analytic_bytes(numel: int, counts: list[int], bits: int, block: int, pattern: str = "auto") -> list[tuple[int, int]]:
    """(sent, received) bytes of every holder, in rank order, to reduce one vector of ``numel`` values;
    ``counts[j]`` is the number of the module's trainees on holder j (one holder: nothing moves)."""
    n = len(counts)
    if n <= 1:
        return [(0, 0)] * n
    if bits < 32:  # every trainee's own payload to every other holder
        if pattern_error(bits, pattern):
            raise ValueError(pattern_error(bits, pattern))
        p = payload_bytes(numel, bits, block)
        return [((n - 1) * k * p, (sum(counts) - k) * p) for k in counts]
    if chosen_pattern(pattern, n, bits) == "allgather":  # one fp32 partial sum per holder
        p = payload_bytes(numel, bits, block)
        return [((n - 1) * p, (n - 1) * p)] * n
    return [(allreduce_bytes(numel, n, bits),) * 2] * n


def allreduce_bytes(numel: int, n: int, bits: int) -> int:
    """Bytes each of n ranks sends (= receives) in a reduce-scatter + all-gather of ``numel`` values at 16 or 32
    bits: dipaco's 32-bit ``reduce_scatter``, and the bf16 gradient all-reduce of the data-parallel reference
    in the benchmarks (which re-rounds partial sums: fine for that reference, not for dipaco's transport)."""
    return 0 if n <= 1 else 2 * (n - 1) * payload_bytes(-(-numel // n), bits, 128)


class DistWorld:
    """Workers under torchrun (``make_world``); call ``setup(holders)`` once, in the same order on every rank."""

    def __init__(self, bits: int = 32, block: int = 128, pattern: str = "auto", mbit: float = 0.0,
                 latency_ms: float = 0.0, device: str = "cpu"):
        import torch.distributed as dist

        if pattern_error(bits, pattern):
            raise DipacoError(pattern_error(bits, pattern))
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
        self.trainees_on: dict[str, dict[int, list[int]]] = {}  # module -> holder rank -> its trainees, sorted
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dipaco-comm")
        self.module_bytes: dict[str, list[int]] = {}  # module -> [sent, received] over the whole run
        self.lock = threading.Lock()  # the communication thread updates the counters
        self.reset_stats()

    def setup(self, holders: dict[str, dict[int, int]]) -> None:
        """``holders``: {module: {trainee: rank}}. One group per distinct holder set of two or more ranks,
        created in sorted order on every rank."""
        for m, trainee_ranks in holders.items():
            on: dict[int, list[int]] = {}
            for i in sorted(trainee_ranks):
                on.setdefault(trainee_ranks[i], []).append(i)
            self.trainees_on[m] = dict(sorted(on.items()))
            self.holders[m] = tuple(self.trainees_on[m])
        for ranks in sorted({r for r in self.holders.values() if len(r) > 1}):
            group = self.dist.new_group(list(ranks))
            if self.rank in ranks:
                self.groups[ranks] = group

    # ------------------------------------------------------------------------------ reductions
    def start_reduce(self, deltas: dict[str, dict[int, dict[str, torch.Tensor]]], weights: dict[str, dict[int, float]]):
        future: Future = self.executor.submit(self._reduce_all, deltas, weights)
        return _Waiting(future, self)

    def _reduce_all(self, deltas, weights):
        began, sent, received = time.perf_counter(), 0, 0
        out = {}
        for m, by_trainee in deltas.items():
            total, s, r = self._reduce_module(m, by_trainee, weights[m])
            out[m] = unflatten(total, next(iter(by_trainee.values())))
            sent, received = sent + s, received + r
            if s or r:
                counts = self.module_bytes.setdefault(m, [0, 0])
                counts[0], counts[1] = counts[0] + s, counts[1] + r
        self._simulate_link(began, sent, received, deltas)
        with self.lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.comm_seconds += time.perf_counter() - began
        return out

    def _reduce_module(self, m: str, by_trainee: dict[int, dict[str, torch.Tensor]],
                       weights: dict[int, float]) -> tuple[torch.Tensor, int, int]:
        """Δ_m as one flat fp32 vector, and the bytes this rank sent and received for it."""
        ranks = self.holders.get(m, (self.rank,))
        flats = {i: flatten(d).to(self.device) for i, d in by_trainee.items()}
        if self.bits == 32:  # exact: add this worker's trainees here, then the holders' partial sums
            partial = weighted_sum(flats, weights)
            return (partial, 0, 0) if len(ranks) == 1 else self._sum_partials(partial, ranks)
        payloads = {i: quantize(f, self.bits, self.block) for i, f in flats.items()}
        sent = received = 0
        if len(ranks) > 1:
            payloads, sent, received = self._gather_payloads(m, payloads, ranks)
        numel = next(iter(flats.values())).numel()
        vectors = {i: dequantize(p, numel, self.bits, self.block) for i, p in payloads.items()}
        return weighted_sum(vectors, weights), sent, received

    def _gather_payloads(self, m: str, mine: dict[int, torch.Tensor], ranks: tuple[int, ...]):
        """Every trainee's payload of module m on every holder: an all-gather of this rank's payloads, done as
        an all-to-all whose split sizes follow each holder's trainee count (uneven counts need no padding)."""
        on, me = self.trainees_on[m], ranks.index(self.rank)
        size = next(iter(mine.values())).numel()  # the same for every trainee: same numel, same bits
        own = torch.cat([mine[i] for i in on[self.rank]])
        send = [0 if j == me else own.numel() for j in range(len(ranks))]
        recv = [0 if r == self.rank else len(on[r]) * size for r in ranks]
        incoming = torch.empty(sum(recv), dtype=torch.uint8, device=own.device)
        self.dist.all_to_all_single(incoming, own.repeat(len(ranks) - 1), recv, send, group=self.groups[ranks])
        payloads, offset = dict(mine), 0
        for r in ranks:
            if r == self.rank:
                continue
            for i in on[r]:
                payloads[i] = incoming[offset:offset + size]
                offset += size
        return payloads, sum(send), sum(recv)

    def _sum_partials(self, partial: torch.Tensor, ranks: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
        """fp32 partial sums of the holders, added (bits = 32 only, where any pattern is exact up to reassociation)."""
        dist, group, n = self.dist, self.groups[ranks], len(ranks)
        if chosen_pattern(self.pattern, n, self.bits) == "allgather":
            bufs = [torch.empty_like(partial) for _ in range(n)]
            dist.all_gather(bufs, partial, group=group)
            total = torch.zeros_like(partial)
            for b in bufs:  # rank order: the same sum on every holder
                total += b
            return total, (n - 1) * 4 * partial.numel(), (n - 1) * 4 * partial.numel()
        chunk = -(-partial.numel() // n)
        padded = torch.zeros(chunk * n, dtype=torch.float32, device=partial.device)
        padded[:partial.numel()] = partial
        incoming = torch.empty_like(padded)
        dist.all_to_all_single(incoming, padded, group=group)
        mine = torch.zeros(chunk, dtype=torch.float32, device=partial.device)
        for piece in incoming.view(n, chunk):  # rank order
            mine += piece
        bufs = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(bufs, mine, group=group)
        total = torch.cat(bufs)[:partial.numel()]
        return total, 2 * (n - 1) * 4 * chunk, 2 * (n - 1) * 4 * chunk

    def _simulate_link(self, began: float, sent: int, received: int, deltas) -> None:
        if not (self.mbit or self.latency):
            return
        messages = sum(len(self.holders.get(m, (0,))) - 1 for m in deltas)
        target = (max(sent, received) * 8 / (self.mbit * 1e6) if self.mbit else 0.0) + self.latency * messages
        left = target - (time.perf_counter() - began)
        if left > 0:
            time.sleep(left)

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
    c = cfg.comm
    if not launched():
        return LocalWorld(c.bits, c.block_size)
    return DistWorld(c.bits, c.block_size, c.pattern, c.simulate_mbit, c.simulate_latency_ms, device)
