"""Quantized transport: round-trip error bounds, payload sizes, per-trainee quantization in the world of one
and on 3 gloo ranks (uneven trainees), byte counts."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dipaco.comm import LocalWorld, analytic_bytes, chosen_pattern
from dipaco.config import TrainConfig, resolve
from dipaco.errors import DipacoError
from dipaco.quant import dequantize, payload_bytes, quantize


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
    # bits < 32: always the all-gather of per-trainee payloads; at 32 bits the fewer-bytes pattern
    assert chosen_pattern("auto", 3, 4) == chosen_pattern("auto", 8, 16) == "allgather"
    assert chosen_pattern("auto", 2, 32) == "allgather" and chosen_pattern("auto", 3, 32) == "reduce_scatter"
    for n in (2, 3, 4, 8):
        auto = analytic_bytes(10_000, [1] * n, 32, 128)
        assert auto <= min(analytic_bytes(10_000, [1] * n, 32, 128, p) for p in ("allgather", "reduce_scatter"))
    assert analytic_bytes(1000, [3], 4, 128) == [(0, 0)]  # one holder: the round trip is local
    assert analytic_bytes(1000, [1, 1, 1], 32, 128, "allgather") == [(2 * 4000, 2 * 4000)] * 3
    assert analytic_bytes(999, [2, 1, 1], 32, 128, "reduce_scatter") == [(2 * 2 * 333 * 4, 2 * 2 * 333 * 4)] * 3
    p = payload_bytes(1000, 4, 128)  # 3 trainees on 2 workers: each trainee's payload crosses once per peer
    assert analytic_bytes(1000, [2, 1], 4, 128) == [(2 * p, p), (p, 2 * p)]
    assert analytic_bytes(1000, [2, 1, 1], 4, 128) == [(4 * p, 2 * p), (2 * p, 3 * p), (2 * p, 3 * p)]
    with pytest.raises(ValueError, match="comm.bits=32"):
        analytic_bytes(1000, [1, 1, 1], 4, 128, "reduce_scatter")
    with pytest.raises(DipacoError, match="use comm.pattern='auto'"):
        resolve(TrainConfig, overrides=["comm.bits=4", "comm.pattern='reduce_scatter'"])
    resolve(TrainConfig, overrides=["comm.bits=32", "comm.pattern='reduce_scatter'"])


def test_world_of_one_quantizes_every_trainee_by_hand():
    """bits = 4 in one process: Σ_i w_i·deq(Q(Δ_i)) over the flattened module, not the fp32 sum."""
    g = torch.Generator().manual_seed(0)
    deltas = {"m": {i: {"a": torch.randn(5, 21, generator=g), "b": torch.randn(7, generator=g) * 1e-3} for i in (2, 0, 1)}}
    weights = {"m": {0: 0.2, 1: 0.3, 2: 0.5}}
    q4 = LocalWorld(bits=4, block=32).start_reduce(deltas, weights).wait()["m"]
    f32 = LocalWorld(bits=32, block=32).start_reduce(deltas, weights).wait()["m"]
    want = torch.zeros(5 * 21 + 7)
    for i in (0, 1, 2):  # by hand, in trainee order
        flat = torch.cat([deltas["m"][i]["a"].reshape(-1), deltas["m"][i]["b"]])
        want.add_(dequantize(quantize(flat, 4, 32), flat.numel(), 4, 32), alpha=weights["m"][i])  # fp32 w·x + acc
    assert torch.equal(torch.cat([q4["a"].reshape(-1), q4["b"]]), want)
    exact = sum(weights["m"][i] * deltas["m"][i]["a"] for i in (0, 1, 2))
    assert torch.allclose(f32["a"], exact, atol=1e-6)
    assert (q4["a"] - f32["a"]).abs().max() > 1e-2  # 4 bits really changed it
    # the last block mixes "b" with "a": one scale, so "b" (1000x smaller) is mostly rounded away
    assert (q4["b"] - f32["b"]).abs().max() > 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# trainees 0, 1 on rank 0, 2 on rank 1, 3 on rank 2 (uneven); "solo": two trainees, one holder
TRAINEE_RANK = {0: 0, 1: 0, 2: 1, 3: 2}
WEIGHTS = {"shared": {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}, "pair": {2: 0.25, 3: 0.75}, "solo": {0: 0.5, 1: 0.5}}
CASES = [("allgather", 4), ("auto", 4), ("auto", 8), ("allgather", 32), ("reduce_scatter", 32), ("auto", 32)]


def _deltas(trainees):
    out = {}
    for m, ws in WEIGHTS.items():
        for i in ws:
            if i in trainees:
                g = torch.Generator().manual_seed(100 * i + len(m))
                out.setdefault(m, {})[i] = {"a": torch.randn(5, 21, generator=g), "b": torch.randn(7, generator=g)}
    return out


def _worker(rank, size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    from dipaco.comm import DistWorld

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


def test_per_trainee_transport_on_three_gloo_ranks(tmp_path):
    """Uneven trainees (2, 1, 1) on 3 ranks: at 4 and 8 bits every holder gets exactly the world of one's
    Σ w_i·deq(Q(Δ_i)); at 32 bits the exact sum; bytes equal the analytic count."""
    mp.start_processes(_worker, args=(3, _free_port(), str(tmp_path)), nprocs=3, join=True, start_method="spawn")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    holders = {m: sorted({TRAINEE_RANK[i] for i in ws}) for m, ws in WEIGHTS.items()}
    for pattern, bits in CASES:
        one = LocalWorld(bits, 32).start_reduce(_deltas(list(TRAINEE_RANK)), WEIGHTS).wait()
        for m, ranks in holders.items():
            for r in ranks:
                got = res[r][(pattern, bits)][0][m]
                if bits < 32 or len(ranks) == 1:  # the same numbers added in the same order
                    assert all(torch.equal(got[n], one[m][n]) for n in ("a", "b")), (pattern, bits, m, r)
                else:
                    assert all(torch.allclose(got[n], one[m][n], atol=1e-6) for n in ("a", "b"))
                    first = res[ranks[0]][(pattern, bits)][0][m]
                    assert all(torch.equal(got[n], first[n]) for n in ("a", "b"))  # holders agree bit for bit
            for r in set(range(3)) - set(ranks):  # nothing is sent for a module a rank does not hold
                assert m not in res[r][(pattern, bits)][2]
        for r in range(3):
            stats = res[r][(pattern, bits)][1]
            want_sent = want_received = 0
            for m, ranks in holders.items():
                if r in ranks:
                    counts = [sum(TRAINEE_RANK[i] == h for i in WEIGHTS[m]) for h in ranks]
                    s, v = analytic_bytes(5 * 21 + 7, counts, bits, 32, pattern)[ranks.index(r)]
                    want_sent, want_received = want_sent + s, want_received + v
            assert (stats["bytes_sent"], stats["bytes_received"]) == (want_sent, want_received), (pattern, bits, r)
