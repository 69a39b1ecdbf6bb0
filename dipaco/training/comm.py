"""Communication between workers. The only file that imports torch.distributed.

``World`` (below) is the interface ``training.sync``, ``storage.checkpoint`` and ``training.train`` use; two worlds
implement it: ``LocalWorld`` (no launcher: every trainee in this process) and ``DistWorld`` (torchrun).
``World.start_reduce`` is where a module's outer gradients meet: it returns a handle to every module's
``module_average`` (``training.outer``) as the transport carries it.

Transport (``comm.bits``), one definition on every layout, so a config computes the same thing on any number
of workers (the world of one included):
  bits < 32   up and down quantization: ``Δ_m = Q_down(Σ_i w_i·deq(Q_up(Δ_i)))``. Q_up: each trainee's Δ_i (the
              module's or fragment's tensors flattened in a fixed name order) is quantized once, as if sent from
              its own worker. The terms are added in fp32 in trainee-index order (``module_average``). Q_down: the
              sum is quantized again blockwise from index 0 and dequantized, as the owner of a reduce-scatter
              chunk does before the all-gather; the chunks are whole blocks, so quantizing chunk by chunk is
              quantizing the whole vector. Every holder applies the same Δ_m, bit for bit, whichever pattern
              carried it; the world of one and a module held by one worker do both steps locally (zero bytes).
              ``bits = 16`` is the same rule with bf16 rounding as Q.
  bits = 32   exact: no Q, so a worker may send the fp32 partial sum of its own trainees and the holders add
              the partial sums (equal to the world of one up to fp32 reassociation).

``LocalWorld``: nothing crosses a wire. ``DistWorld``: one process group per distinct set of holders, created once in
the same order on every rank, so a module's outer gradient goes only to the workers that hold it. Reductions run on
one background thread, in the order they were started (the same on every rank), so a reduction overlaps with the
inner steps that follow it until ``wait``.

Collective patterns for a group of n holders, holder j with k_j of the module's trainees (T = Σk), a payload
of P bytes per trainee (or fp32 partial sum) and p_j bytes for chunk j of it (p_j ≈ P/n):
  allgather       every holder's payloads go to every other holder (an all-gather; an all-to-all with
                  split sizes when the k_j differ, so nothing is padded), each holder adds them and applies
                  Q_down itself: holder j sends (n−1)·k_j·P and receives (T − k_j)·P. bits = 32 sends one
                  partial sum (k_j counts as 1).
  reduce_scatter  bits < 32: chunk j (whole blocks, ``chunk_bounds``) of every trainee's payload goes to holder j
                  (an all-to-all: several trainees on a worker -> several payloads), which adds its chunk over all
                  trainees, applies Q_down and all-gathers the result: holder j sends k_j·(P − p_j) + (n−1)·p_j and
                  receives (T − k_j)·p_j + P − p_j; one trainee per holder: 2(n−1)/n·P each way.
                  bits = 32: the fp32 partial sum is cut into n chunks instead; 2(n−1)/n·P per rank.
``auto``: at 32 bits all-gather for n = 2 and reduce-scatter from n = 3; below 32 bits the reduce-scatter, which
never moves more bytes, except for 2 holders with one trainee each (the same bytes, one collective instead of two).
The pattern changes bytes, never the result. Every holder ends with the same bytes, dequantizes them the same way
and adds them in the same order: shared modules stay bit-identical on all their holders.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from dipaco.training.outer import module_average
from dipaco.training.quant import dequantize, payload_bytes, quantize


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


def reduce_here(flats: dict[int, torch.Tensor], weights: dict[int, float], bits: int, block: int) -> torch.Tensor:
    """Δ_m with every term at hand (one world, one holder): Q_down(Σ_i w_i·deq(Q_up(Δ_i))); exact at 32 bits."""
    return reduce_arrived({i: round_trip(f, bits, block) for i, f in flats.items()}, weights, bits, block)


def reduce_arrived(vectors: dict[int, torch.Tensor], weights: dict[int, float], bits: int, block: int) -> torch.Tensor:
    """Δ_m from the outer gradients as they arrived (``deq(Q_up(Δ_i))``, or Δ_i itself at 32 bits): the weighted sum
    in trainee-index order, then Q_down. The Ray engine's outer executors reduce the payloads phases wrote with it."""
    total = module_average(vectors, weights)
    return total if bits == 32 else round_trip(total, bits, block)


def chunk_bounds(numel: int, n: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of the n reduce-scatter chunks of a flat vector below 32 bits: holder j owns blocks
    ⌊jB/n⌋ .. ⌊(j+1)B/n⌋ − 1 of the B blocks counted from index 0, so a chunk is whole blocks (the vector's
    last, partial block included) and quantizing it is quantizing those blocks of the whole vector."""
    blocks = -(-numel // block)
    cuts = [min(numel, (j * blocks // n) * block) for j in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


Deltas = dict[str, dict[int, dict[str, torch.Tensor]]]  # {module: {trainee: {name: Δ_i}}}
Reduced = dict[str, dict[str, torch.Tensor]]             # {module: {name: Δ_m}}


class Handle(Protocol):
    def wait(self) -> Reduced:
        """Block until the reduction is done; its result (the same object on every call)."""


class World(Protocol):
    """The workers around this one, as the round loop, the sync and the checkpoint commit see them."""

    rank: int
    size: int
    module_bytes: dict[str, list[int]]  # module -> [sent, received] over the whole run

    def setup(self, holders: dict[str, dict[int, int]]) -> None:
        """Once, before any reduction: ``{module: {trainee: rank}}`` for every trainee whose path holds the module."""

    def start_reduce(self, deltas: Deltas, weights: dict[str, dict[int, float]]) -> Handle:
        """Start averaging every module's outer gradient; the handle's ``wait()`` gives ``{module: {name: Δ_m}}``,
        ``Δ_m = Σ_i w_i·T(Δ_i)`` (``module_average`` under the transport T of ``comm.bits``) over all the
        module's trainees, the same bits on every holder. ``deltas``: this worker's trainees' Δ_i (fp32);
        ``weights``: ``{module: {trainee: w_i}}`` for all of the module's trainees, on every worker."""

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0, in rank order (None on the other ranks)."""

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""

    def stats(self) -> dict:
        """Cumulative bytes_sent, bytes_received, comm_s (reducing) and wait_s (blocked in ``wait``)."""

    def close(self) -> None:
        """After the last round (waits for the communication thread)."""


class Ready:
    """A handle whose result is already there (the world of one; reductions a checkpoint waited for or restored)."""

    def __init__(self, value: Reduced):
        self.value = value

    def wait(self) -> Reduced:
        return self.value


class LocalWorld:
    """All trainees in this process: the quantize -> dequantize round trip happens here, zero bytes move."""

    rank = 0
    size = 1

    def __init__(self, bits: int = 32, block: int = 128):
        self.bits, self.block = bits, block
        self.module_bytes: dict[str, list[int]] = {}

    def setup(self, holders: dict[str, dict[int, int]]) -> None:
        pass

    def start_reduce(self, deltas: Deltas, weights: dict[str, dict[int, float]]) -> Ready:
        out = {}
        for m, by_trainee in deltas.items():
            flats = {i: flatten(d) for i, d in by_trainee.items()}
            out[m] = unflatten(reduce_here(flats, weights[m], self.bits, self.block), next(iter(by_trainee.values())))
        return Ready(out)

    def gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj

    def stats(self) -> dict:  # nothing crosses a wire, nothing waits
        return {"bytes_sent": 0, "bytes_received": 0, "comm_s": 0.0, "wait_s": 0.0}

    def close(self) -> None:
        pass


def launched() -> bool:
    """True when this process runs under torchrun (or another env:// launcher) with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def chosen_pattern(pattern: str, counts: list[int], bits: int) -> str:
    """The collective for holders with ``counts[j]`` of the module's trainees (see the module docstring)."""
    if pattern != "auto":
        return pattern
    n = len(counts)
    if bits == 32:
        return "allgather" if n <= 2 else "reduce_scatter"
    # per holder the reduce-scatter sends k_j·(P − p_j) + (n−1)·p_j <= (n−1)·k_j·P, equal only for one trainee on each of 2
    return "allgather" if n <= 2 and sum(counts) <= 2 else "reduce_scatter"


def analytic_bytes(numel: int, counts: list[int], bits: int, block: int, pattern: str = "auto") -> list[tuple[int, int]]:
    """(sent, received) bytes of every holder, in rank order, to reduce one vector of ``numel`` values;
    ``counts[j]`` is the number of the module's trainees on holder j (one holder: nothing moves)."""
    n, total = len(counts), sum(counts)
    if n <= 1:
        return [(0, 0)] * n
    chosen = chosen_pattern(pattern, counts, bits)
    if bits == 32:  # one fp32 partial sum per holder
        if chosen == "allgather":
            p = payload_bytes(numel, bits, block)
            return [((n - 1) * p, (n - 1) * p)] * n
        return [(allreduce_bytes(numel, n, bits),) * 2] * n
    p = payload_bytes(numel, bits, block)
    if chosen == "allgather":  # every trainee's own payload to every other holder
        return [((n - 1) * k * p, (total - k) * p) for k in counts]
    chunks = [payload_bytes(e - s, bits, block) for s, e in chunk_bounds(numel, n, block)]
    # up: my trainees' other chunks out, the other trainees' chunk of mine in; down: my summed chunk out, the rest in
    return [(k * (p - c) + (n - 1) * c, (total - k) * c + p - c) for k, c in zip(counts, chunks)]


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
    def start_reduce(self, deltas: Deltas, weights: dict[str, dict[int, float]]) -> _Waiting:
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
        if len(ranks) == 1:
            return reduce_here(flats, weights, self.bits, self.block), 0, 0
        if self.bits == 32:  # exact: this worker's trainees' share of the average here, then the holders add the shares
            return self._sum_partials(module_average(flats, weights), ranks)
        counts = [len(self.trainees_on[m][r]) for r in ranks]
        if chosen_pattern(self.pattern, counts, self.bits) == "reduce_scatter":
            return self._reduce_scatter_payloads(m, flats, weights, ranks)
        numel = next(iter(flats.values())).numel()
        payloads = {i: quantize(f, self.bits, self.block) for i, f in flats.items()}
        payloads, sent, received = self._gather_payloads(m, payloads, ranks)
        vectors = {i: dequantize(p, numel, self.bits, self.block) for i, p in payloads.items()}
        return round_trip(module_average(vectors, weights), self.bits, self.block), sent, received

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

    def _reduce_scatter_payloads(self, m: str, flats: dict[int, torch.Tensor], weights: dict[int, float],
                                 ranks: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
        """bits < 32: chunk j of every trainee's Δ_i, quantized (Q_up), goes to holder j, which adds its chunk over
        all trainees in trainee-index order, re-quantizes it (Q_down) and all-gathers it. Both steps are
        all-to-alls with split sizes: chunks differ in bytes when the blocks do not divide evenly."""
        bits, block, group = self.bits, self.block, self.groups[ranks]
        on, me, n = self.trainees_on[m], ranks.index(self.rank), len(ranks)
        numel = next(iter(flats.values())).numel()
        bounds = chunk_bounds(numel, n, block)
        lengths = [e - s for s, e in bounds]
        sizes = [payload_bytes(k, bits, block) for k in lengths]
        mine = on[self.rank]
        # up: per trainee and chunk, so a trainee's values are quantized exactly as its whole vector would be
        up = [[quantize(flats[i][s:e], bits, block) for i in mine] for s, e in bounds]
        send = [0 if j == me else len(mine) * sizes[j] for j in range(n)]
        recv = [0 if j == me else len(on[r]) * sizes[me] for j, r in enumerate(ranks)]
        outgoing = torch.cat([q for j in range(n) if j != me for q in up[j]])
        incoming = torch.empty(sum(recv), dtype=torch.uint8, device=outgoing.device)
        self.dist.all_to_all_single(incoming, outgoing, recv, send, group=group)
        vectors = {i: dequantize(q, lengths[me], bits, block) for i, q in zip(mine, up[me])}
        offset = 0
        for j, r in enumerate(ranks):
            for i in on[r] if j != me else ():
                vectors[i] = dequantize(incoming[offset:offset + sizes[me]], lengths[me], bits, block)
                offset += sizes[me]
        # down: the summed chunk, quantized once by its owner, to every other holder
        down = quantize(module_average(vectors, weights), bits, block)
        send2 = [0 if j == me else sizes[me] for j in range(n)]
        recv2 = [0 if j == me else sizes[j] for j in range(n)]
        incoming = torch.empty(sum(recv2), dtype=torch.uint8, device=down.device)
        self.dist.all_to_all_single(incoming, down.repeat(n - 1), recv2, send2, group=group)
        pieces, offset = [], 0
        for j in range(n):
            if j == me:
                pieces.append(dequantize(down, lengths[j], bits, block))
            else:
                pieces.append(dequantize(incoming[offset:offset + sizes[j]], lengths[j], bits, block))
                offset += sizes[j]
        return torch.cat(pieces), sum(send) + sum(send2), sum(recv) + sum(recv2)

    def _sum_partials(self, partial: torch.Tensor, ranks: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
        """fp32 partial sums of the holders, added (bits = 32 only, where any pattern is exact up to reassociation)."""
        dist, group, n = self.dist, self.groups[ranks], len(ranks)
        if chosen_pattern(self.pattern, [1] * n, self.bits) == "allgather":
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
        messages = 0
        for m in deltas:  # a reduce-scatter talks to every peer twice
            counts = [len(t) for t in self.trainees_on.get(m, {0: [0]}).values()]
            steps = 2 if chosen_pattern(self.pattern, counts, self.bits) == "reduce_scatter" else 1
            messages += steps * (len(counts) - 1)
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


def make_world(cfg, device: str) -> World:
    """A DistWorld under a launcher, else the world of one."""
    c = cfg.comm
    if not launched():
        return LocalWorld(c.bits, c.block_size)
    return DistWorld(c.bits, c.block_size, c.pattern, c.simulate_mbit, c.simulate_latency_ms, device)
