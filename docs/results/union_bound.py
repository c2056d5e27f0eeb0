#!/usr/bin/env python3
"""The best a sparse MLP could do at uniform density on the H200, as a model.

A kernel that stages weight rows on chip and shares them among a tile of T tokens reads
each row once per tile that needs it; at uniform density p a tile needs the fraction
u = 1 - (1 - p)^T of the neurons. On tensor cores it computes the whole union (u of a
dense projection); through L2 it moves (M / T) * u * f * d * 2 bytes. Each projection
(up, down) takes the larger of the two at the best T; the gate is a dense GEMM; the
pack takes its measured time. Printed: the speed-up over candle's dense MLP at the best
tile, and at T = 1: the floor of a per-pair design (each active pair's weight rows read
from L2, no reuse), which is what the row kernels are.

Measured against it (thirty-fifth session, docs/kernel-notes.md): the union kernels at
T = 64 on mma.sync ran 1.7-2.7x slower than this model's time for them, and slower than
the row kernels. What the model leaves out: the tensor cores reach about a third of
their peak there, x is read again for every block of members, and h = g * u needs each
(token, member)'s gate value gathered, each its own L2 sector; at 0.5% and T = 64 the
union saves only 16% of the weight rows that would carry those costs.

usage: python3 docs/results/union_bound.py
"""
F, D = 5632, 2048
TFLOPS, L2_BYTES_PER_S = 750e12, 8e12  # measured ceilings (docs/kernel-notes.md)
TILES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512]
# M -> (candle's dense MLP ms, the pack's ms), docs/benchmarks.md (65536: the mask pack,
# docs/kernel-notes.md "The gate's ReLU mask")
CASES = {65536: (8.6, 0.154), 16384: (2.12, 0.09), 2048: (0.293, 0.016)}


def projection_ms(m: int, p: float, tiles=TILES) -> tuple:
    """The least time of one sparse projection over the tile sizes, and that tile."""
    gemm_ms = 2 * m * F * D / TFLOPS * 1e3
    best = None
    for t in tiles:
        union = 1 - (1 - p) ** t
        compute = union * gemm_ms if t > 1 else 0.0  # one token: no tensor-core tile
        traffic = (m / t) * union * F * D * 2 / L2_BYTES_PER_S * 1e3
        cost = max(compute, traffic)
        if best is None or cost < best[0]:
            best = (cost, t)
    return best


def main() -> None:
    print("| M | density | best tile | sparse ms at best | speed-up at best | per pair (T = 1) |")
    print("|---|---|---|---|---|---|")
    for m, (dense_ms, pack_ms) in CASES.items():
        gate_ms = 2 * m * F * D / TFLOPS * 1e3
        for p in (0.005, 0.01, 0.03):
            proj, tile = projection_ms(m, p)
            total = gate_ms + pack_ms + 2 * proj
            pair_total = gate_ms + pack_ms + 2 * projection_ms(m, p, [1])[0]
            print(
                f"| {m} | {p:.1%} | {tile} | {total:.3f} | {dense_ms / total:.2f}x "
                f"| {dense_ms / pair_total:.2f}x |"
            )


if __name__ == "__main__":
    main()
