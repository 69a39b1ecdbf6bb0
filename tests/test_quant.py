"""Quantized transport: round-trip error bounds, payload sizes, and the collective patterns on 3 gloo ranks."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dipaco.comm import analytic_bytes, chosen_pattern
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


def test_pattern_choice_minimises_bytes():
    assert chosen_pattern("auto", 2) == "allgather" and chosen_pattern("auto", 3) == "reduce_scatter"
    for n in (2, 3, 4, 8):
        auto = analytic_bytes(10_000, n, 4, 128, "auto")
        assert auto <= min(analytic_bytes(10_000, n, 4, 128, p) for p in ("allgather", "reduce_scatter"))
    assert analytic_bytes(1000, 1, 4, 128, "auto") == 0
    assert analytic_bytes(1000, 3, 32, 128, "allgather") == 2 * 4000
    assert analytic_bytes(999, 3, 32, 128, "reduce_scatter") == 2 * 2 * 333 * 4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    from dipaco.comm import DistWorld

    results = {}
    for pattern in ("allgather", "reduce_scatter"):
        for bits in (4, 32):
            world = DistWorld(bits=bits, block=32, pattern=pattern) if not results else world
            world.bits, world.pattern = bits, pattern
            if not results:
                world.setup({"shared": [0, 1, 2], "pair": [1, 2], "solo": [0]})
            world.reset_stats()
            g = torch.Generator().manual_seed(100 + rank)
            grads = {m: {"a": torch.randn(5, 21, generator=g), "b": torch.randn(7, generator=g)}
                     for m in ("shared", "pair", "solo") if rank in {"shared": [0, 1, 2], "pair": [1, 2], "solo": [0]}[m]}
            reduced = world.start_reduce(grads).wait()
            results[(pattern, bits)] = ({m: {n: t.clone() for n, t in d.items()} for m, d in reduced.items()},
                                        world.stats(), {m: list(v) for m, v in world.module_bytes.items()})
    world.close()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_patterns_on_three_gloo_ranks(tmp_path):
    mp.start_processes(_worker, args=(3, _free_port(), str(tmp_path)), nprocs=3, join=True, start_method="spawn")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    holders = {"shared": [0, 1, 2], "pair": [1, 2], "solo": [0]}
    exact = {}
    for m, ranks in holders.items():
        parts = []
        for r in ranks:
            g = torch.Generator().manual_seed(100 + r)
            draws = {}
            for mm in ("shared", "pair", "solo"):
                if r in holders[mm]:
                    draws[mm] = (torch.randn(5, 21, generator=g), torch.randn(7, generator=g))
            parts.append(draws[m])
        exact[m] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
    for (pattern, bits) in [("allgather", 4), ("allgather", 32), ("reduce_scatter", 4), ("reduce_scatter", 32)]:
        for m, ranks in holders.items():
            got = [res[r][(pattern, bits)][0][m] for r in ranks]
            for other in got[1:]:  # every holder ends with the very same bits
                assert all(torch.equal(got[0][n], other[n]) for n in ("a", "b"))
            tol = 1e-5 if bits == 32 or len(ranks) == 1 else 0.35 * len(ranks)
            assert torch.allclose(got[0]["a"], exact[m][0], atol=tol) and torch.allclose(got[0]["b"], exact[m][1], atol=tol)
            for r in set(range(3)) - set(ranks):  # nothing is sent for a module a rank does not hold
                assert m not in res[r][(pattern, bits)][2]
        for r in range(3):
            stats = res[r][(pattern, bits)][1]
            want = sum(analytic_bytes(5 * 21 + 7, len(ranks), bits, 32, pattern) for m, ranks in holders.items() if r in ranks)
            assert stats["bytes_sent"] == stats["bytes_received"] == want
