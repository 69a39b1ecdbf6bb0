"""Quantized transport: round-trip error bounds, payload sizes, up and down quantization in the world of one
and on 4 gloo ranks (uneven trainees, both patterns, empty reduce-scatter chunks), byte counts."""

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from dipaco.config import TrainConfig, resolve
from dipaco.training.comm import LocalWorld, analytic_bytes, chosen_pattern, chunk_bounds
from dipaco.training.launch import free_port
from dipaco.training.quant import dequantize, payload_bytes, quantize


@pytest.mark.parametrize("bits,qmax", [(4, 7), (8, 127)])
def test_round_trip_error_is_within_half_a_step(bits, qmax):
    torch.manual_seed(0)
    block = 64
    x = torch.randn(1000) * torch.logspace(-6, 1, 1000)  # blocks of very different magnitude
    payload = quantize(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(1000, bits, block)
    y = dequantize(payload, 1000, bits, block)
    padded = torch.zeros(16 * block)
    padded[:1000] = x
    absmax = padded.view(16, block).abs().amax(1).repeat_interleave(block)[:1000]
    bound = absmax / (2 * qmax) * 1.011  # half a step of the rounded-up bf16 scale
    assert torch.all((x - y).abs() <= bound)
    assert torch.equal(dequantize(quantize(torch.zeros(70), bits, block), 70, bits, block), torch.zeros(70))


def test_fp32_is_exact_and_bf16_is_close():
    x = torch.randn(333)
    assert torch.equal(dequantize(quantize(x, 32, 128), 333, 32, 128), x)
    y = dequantize(quantize(x, 16, 128), 333, 16, 128)
    assert torch.all((x - y).abs() <= x.abs() * 2 ** -8)
    assert payload_bytes(333, 32, 128) == 1332 and payload_bytes(333, 16, 128) == 666


def test_payload_sizes():
    assert payload_bytes(256, 4, 128) == 128 + 4  # 4 bits per value + one bf16 scale per block
    assert payload_bytes(257, 4, 128) == 192 + 6
    assert payload_bytes(256, 8, 128) == 256 + 4
    # bytes per value at 4 bits with blocks of 128: 4.125 bits
    assert payload_bytes(128 * 1000, 4, 128) * 8 / (128 * 1000) == pytest.approx(4.125)


def test_pattern_choice_and_analytic_bytes():
    # auto: the pattern with fewer bytes; below 32 bits all-gather only for 2 holders with one trainee each
    assert chosen_pattern("auto", [1, 1], 4) == "allgather" and chosen_pattern("auto", [1, 1, 1], 4) == "reduce_scatter"
    assert chosen_pattern("auto", [2, 2], 4) == chosen_pattern("auto", [2, 1], 16) == "reduce_scatter"
    assert chosen_pattern("auto", [2, 2], 32) == "allgather" and chosen_pattern("auto", [1, 1, 1], 32) == "reduce_scatter"
    assert chosen_pattern("allgather", [1] * 4, 4) == "allgather"
    for bits in (4, 8, 16, 32):
        for counts in ([1, 1], [2, 2], [2, 1], [1, 1, 1], [2, 1, 1], [1] * 4, [3, 1, 2, 1], [1] * 8):
            for numel in (40, 1000, 10_000):  # 40 < one block of 128: some reduce-scatter chunks are empty
                auto = analytic_bytes(numel, counts, bits, 128)
                for p in ("allgather", "reduce_scatter"):
                    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(auto, analytic_bytes(numel, counts, bits, 128, p)))
    assert analytic_bytes(1000, [3], 4, 128) == [(0, 0)]  # one holder: both round trips are local
    assert analytic_bytes(1000, [1, 1, 1], 32, 128, "allgather") == [(2 * 4000, 2 * 4000)] * 3
    assert analytic_bytes(999, [2, 1, 1], 32, 128, "reduce_scatter") == [(2 * 2 * 333 * 4, 2 * 2 * 333 * 4)] * 3
    p = payload_bytes(1000, 4, 128)  # all-gather: each trainee's payload crosses once per peer
    assert analytic_bytes(1000, [2, 1], 4, 128, "allgather") == [(2 * p, p), (p, 2 * p)]
    assert analytic_bytes(1000, [2, 1, 1], 4, 128, "allgather") == [(4 * p, 2 * p), (2 * p, 3 * p), (2 * p, 3 * p)]
    for bits in (4, 32):  # any pattern at any width: the pattern changes bytes, not the result
        assert resolve(TrainConfig, overrides=[f"comm.bits={bits}", "comm.pattern='reduce_scatter'"]).comm.bits == bits


def test_reduce_scatter_sends_two_n_minus_one_over_n_payloads():
    """4 holders, one trainee each, 4 bits: 2(n−1)/n·P per holder each way (the all-gather: (n−1)·P)."""
    numel, n = 128 * 4 * 25, 4
    p = payload_bytes(numel, 4, 128)
    assert p % n == 0
    assert analytic_bytes(numel, [1] * n, 4, 128) == [(2 * (n - 1) * p // n,) * 2] * n  # 1.5 P
    assert analytic_bytes(numel, [1] * n, 4, 128, "allgather") == [((n - 1) * p,) * 2] * n  # 3 P
    # chunks are whole blocks from index 0, as even as the blocks allow; the partial last block ends the last one
    assert chunk_bounds(1000, 3, 128) == [(0, 256), (256, 640), (640, 1000)]
    assert chunk_bounds(100, 3, 128) == [(0, 0), (0, 0), (0, 100)]
    for numel, n in ((1000, 3), (129, 4), (128 * 7, 4)):
        assert sum(payload_bytes(e - s, 4, 128) for s, e in chunk_bounds(numel, n, 128)) == payload_bytes(numel, 4, 128)


def test_chunks_quantize_like_the_whole_vector():
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.logspace(-4, 1, 1000)
    for bits in (4, 8, 16):
        whole = dequantize(quantize(x, bits, 32), 1000, bits, 32)
        parts = [dequantize(quantize(x[s:e], bits, 32), e - s, bits, 32) for s, e in chunk_bounds(1000, 3, 32)]
        assert torch.equal(torch.cat(parts), whole)


def test_world_of_one_quantizes_up_and_down_by_hand():
    """bits = 4 in one process: Q_down(Σ_i w_i·deq(Q_up(Δ_i))) over the flattened module, not the fp32 sum."""
    g = torch.Generator().manual_seed(0)
    deltas = {"m": {i: {"a": torch.randn(5, 21, generator=g), "b": torch.randn(7, generator=g) * 1e-3} for i in (2, 0, 1)}}
    weights = {"m": {0: 0.2, 1: 0.3, 2: 0.5}}
    q4 = LocalWorld(bits=4, block=32).start_reduce(deltas, weights).wait()["m"]
    f32 = LocalWorld(bits=32, block=32).start_reduce(deltas, weights).wait()["m"]
    summed = torch.zeros(5 * 21 + 7)
    for i in (0, 1, 2):  # by hand, in trainee order: Q_up of each trainee, weighted, added in fp32
        flat = torch.cat([deltas["m"][i]["a"].reshape(-1), deltas["m"][i]["b"]])
        summed += dequantize(quantize(flat, 4, 32), flat.numel(), 4, 32) * weights["m"][i]
    want = dequantize(quantize(summed, 4, 32), summed.numel(), 4, 32)  # Q_down of the sum
    got = torch.cat([q4["a"].reshape(-1), q4["b"]])
    assert torch.equal(got, want)
    assert not torch.equal(got, summed)  # the down step really rounds
    assert len(torch.unique(got[:32] / got[:32].abs().max())) <= 15  # a block of the result holds 4-bit levels
    exact = sum(weights["m"][i] * deltas["m"][i]["a"] for i in (0, 1, 2))
    assert torch.allclose(f32["a"], exact, atol=1e-6)
    assert (q4["a"] - f32["a"]).abs().max() > 1e-2  # 4 bits really changed it
    # the last block mixes "b" with "a": one scale, so "b" (1000x smaller) is mostly rounded away
    assert (q4["b"] - f32["b"]).abs().max() > 0
    # bits = 16: the same rule with bf16 rounding up and down
    q16 = LocalWorld(bits=16, block=32).start_reduce(deltas, weights).wait()["m"]
    bf = torch.zeros(5 * 21 + 7)
    for i in (0, 1, 2):
        flat = torch.cat([deltas["m"][i]["a"].reshape(-1), deltas["m"][i]["b"]])
        bf += flat.bfloat16().float() * weights["m"][i]
    assert torch.equal(torch.cat([q16["a"].reshape(-1), q16["b"]]), bf.bfloat16().float())


# trainees 0, 1 on rank 0, 2 on rank 1, 3 on rank 2, 4 on rank 3 (uneven). Modules: "shared" 4 holders (2, 1, 1, 1);
# "quad" 4 holders with one trainee each and 8 whole blocks (2 per chunk); "pair" 2 holders (1, 1); "duo" 2 holders
# (2, 1); "tiny" 3 holders and one partial block (two empty reduce-scatter chunks); "solo" one holder
TRAINEE_RANK = {0: 0, 1: 0, 2: 1, 3: 2, 4: 3}
WEIGHTS = {"shared": {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.15, 4: 0.25}, "quad": {0: 0.4, 2: 0.1, 3: 0.2, 4: 0.3},
           "pair": {2: 0.25, 3: 0.75}, "duo": {0: 0.3, 1: 0.3, 4: 0.4}, "tiny": {1: 0.5, 2: 0.2, 3: 0.3},
           "solo": {0: 0.5, 1: 0.5}}
SHAPES = {"quad": {"a": (4, 48), "b": (64,)}, "tiny": {"a": (3, 5), "b": (5,)}}
CASES = [("allgather", 4), ("reduce_scatter", 4), ("auto", 4), ("auto", 8), ("reduce_scatter", 16), ("auto", 16),
         ("allgather", 32), ("reduce_scatter", 32), ("auto", 32)]
RANKS = 4


def _deltas(trainees):
    out = {}
    for m, ws in WEIGHTS.items():
        for i in ws:
            if i in trainees:
                g = torch.Generator().manual_seed(100 * i + len(m))
                shapes = SHAPES.get(m, {"a": (5, 21), "b": (7,)})
                out.setdefault(m, {})[i] = {n: torch.randn(*shape, generator=g) for n, shape in shapes.items()}
    return out


def _worker(rank, size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    from dipaco.training.comm import DistWorld

    results, world = {}, None
    for pattern, bits in CASES:
        if world is None:
            world = DistWorld(bits=bits, block=32, pattern=pattern)
            world.setup({m: {i: TRAINEE_RANK[i] for i in ws} for m, ws in WEIGHTS.items()})
        world.bits, world.pattern = bits, pattern
        world.reset_stats()
        world.module_bytes = {}
        reduced = world.start_reduce(_deltas([i for i, r in TRAINEE_RANK.items() if r == rank]), WEIGHTS).wait()
        results[(pattern, bits)] = (reduced, world.stats(), {m: list(v) for m, v in world.module_bytes.items()})
    world.close()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_up_and_down_transport_on_four_gloo_ranks(tmp_path):
    """Uneven trainees on 4 ranks: at 4, 8 and 16 bits every holder gets exactly the world of one's
    Q_down(Σ w_i·deq(Q_up(Δ_i))), through the all-gather and the reduce-scatter alike; at 32 bits the exact
    sum; bytes equal the analytic count, and the reduce-scatter sends 2(n−1)/n·P per holder."""
    mp.start_processes(_worker, args=(RANKS, free_port(), str(tmp_path)), nprocs=RANKS, join=True, start_method="spawn")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]
    holders = {m: sorted({TRAINEE_RANK[i] for i in ws}) for m, ws in WEIGHTS.items()}
    numel = {m: sum(math.prod(s) for s in SHAPES.get(m, {"a": (5, 21), "b": (7,)}).values()) for m in WEIGHTS}
    for pattern, bits in CASES:
        one = LocalWorld(bits, 32).start_reduce(_deltas(list(TRAINEE_RANK)), WEIGHTS).wait()
        for m, ranks in holders.items():
            for r in ranks:
                got = res[r][(pattern, bits)][0][m]
                assert got.keys() == one[m].keys()
                if bits < 32 or len(ranks) == 1:  # the same numbers added in the same order
                    assert all(torch.equal(got[n], one[m][n]) for n in got), (pattern, bits, m, r)
                else:
                    assert all(torch.allclose(got[n], one[m][n], atol=1e-6) for n in got)
                    first = res[ranks[0]][(pattern, bits)][0][m]
                    assert all(torch.equal(got[n], first[n]) for n in got)  # holders agree bit for bit
            for r in set(range(RANKS)) - set(ranks):  # nothing is sent for a module a rank does not hold
                assert m not in res[r][(pattern, bits)][2]
        for r in range(RANKS):
            stats = res[r][(pattern, bits)][1]
            want_sent = want_received = 0
            for m, ranks in holders.items():
                if r in ranks:
                    counts = [sum(TRAINEE_RANK[i] == h for i in WEIGHTS[m]) for h in ranks]
                    s, v = analytic_bytes(numel[m], counts, bits, 32, pattern)[ranks.index(r)]
                    want_sent, want_received = want_sent + s, want_received + v
                    assert res[r][(pattern, bits)][2].get(m, [0, 0]) == ([s, v] if len(ranks) > 1 else [0, 0])
            assert (stats["bytes_sent"], stats["bytes_received"]) == (want_sent, want_received), (pattern, bits, r)
        if bits == 4 and pattern != "allgather":  # "quad": 4 holders, one trainee each, 8 blocks
            p = payload_bytes(numel["quad"], 4, 32)
            assert all(res[r][(pattern, bits)][2]["quad"] == [2 * 3 * p // 4] * 2 for r in range(RANKS))
    # 4 bits really differs from 32 bits (and the all-gather and the reduce-scatter agree bit for bit)
    for m in ("shared", "quad"):
        a, b = res[1][("allgather", 4)][0][m], res[1][("reduce_scatter", 4)][0][m]
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert max((a[n] - res[1][("auto", 32)][0][m][n]).abs().max().item() for n in a) > 1e-2
