#!/usr/bin/env python3
"""Host simulation of `walk_mask_row` (kernels/twell_common.cuh), lane by lane.

The CUDA walk finds each pair's lane by a binary search over the lanes' prefix sums, then
the word among that lane's 8, then the bit; it also writes the row's tile counts and must
ignore the bits past d_ff (the mask rows are padded to 128 bits, their padding unwritten).
This runs the same arithmetic for the 32 lanes of a warp on random rows and checks the
pairs against the mask's set bits in column order, and the counts against a direct count.

    python3 docs/results/gpu-s38/walk_mask_row_sim.py    # prints "ok, N rows walked, N sign masks"

It also builds the sign kernel's mask (`twell_gate_sign_mask_bf16`, kernels/gate_pack.cu)
the way its lanes do and checks that the walk reads the same positives from it.
"""
import random


def popc(x):
    return bin(x).count("1")


def ffs(x):  # CUDA's __ffs: 1-based position of the lowest set bit, 0 for none
    return (x & -x).bit_length()


def walk(row_mask, words_per_row, f, tile_words):
    """The pairs (columns) and {tile: count} that walk_mask_row gives for one row."""
    row_words = (f + 31) >> 5
    pairs, counts = [], {}
    for wb in range(0, row_words, 256):
        kept, sums = [], []
        for lane in range(32):
            w0 = wb + 8 * lane
            if w0 + 8 <= words_per_row:
                words = [row_mask[w0 + i] for i in range(8)]
            else:
                words = [row_mask[w0 + i] if w0 + i < row_words else 0 for i in range(8)]
            total_bits, in_tile, mine = 0, 0, []
            for i in range(8):
                left = f - (w0 + i) * 32
                bits = words[i]
                if left <= 0:
                    bits = 0
                elif left < 32:
                    bits &= (1 << left) - 1
                mine.append(bits)
                total_bits += popc(bits)
                in_tile += popc(bits)
                if ((i + 1) & (tile_words - 1)) == 0:
                    first = w0 + i + 1 - tile_words
                    if first * 32 < f:
                        counts[first // tile_words] = in_tile
                    in_tile = 0
            kept.append(mine)
            sums.append(total_bits)
        incl, acc = [], 0
        for s in sums:
            acc += s
            incl.append(acc)
        excl = [incl[i] - sums[i] for i in range(32)]
        total = incl[31]
        for kb in range(0, total, 32):
            for lane in range(32):
                k = kb + lane
                at = 0
                for step in (16, 8, 4, 2, 1):
                    if incl[at + step - 1] <= k:
                        at += step
                if k >= total:
                    continue
                r = k - excl[at]
                i, bits = 0, kept[at][0]
                while r >= popc(bits):
                    r -= popc(bits)
                    i += 1
                    bits = kept[at][i]
                for _ in range(r):
                    bits &= bits - 1
                pairs.append((wb + 8 * at + i) * 32 + ffs(bits) - 1)
    return pairs, counts


def sign_mask_row(positive, f, words_per_row):
    """The words twell_gate_sign_mask_bf16 writes for one row, lane by lane: per 256-column
    chunk, lane l's byte holds columns 8l .. 8l + 7 (bit q: column 8l + q), and lane k < 8
    writes word 8·chunk + k from lanes 4k .. 4k + 3's bytes, lane 4k's lowest."""
    words = [None] * words_per_row
    for chunk in range((f + 255) >> 8):
        byte = []
        for lane in range(32):
            col = chunk * 256 + lane * 8
            ok = col < f
            byte.append(sum(1 << q for q in range(8) if ok and positive[col + q]) if ok else 0)
        for lane in range(8):
            src = 4 * (lane & 7)
            word = chunk * 8 + lane
            if word < words_per_row:
                words[word] = byte[src] | byte[src + 1] << 8 | byte[src + 2] << 16 | byte[src + 3] << 24
    return words


def main():
    random.seed(1)
    rows = 300
    for _ in range(rows):
        f = random.choice([32, 100, 256, 1536, 5632, 5640, 8192, 8200, 11008, 16461])
        tile = random.choice([32, 64, 128, 256])
        words_per_row = (f + 127) // 128 * 4
        p = random.choice([0.0, 0.005, 0.03, 0.3, 1.0])
        cols = [c for c in range(f) if random.random() < p]
        # Garbage in every padding word and in the last word's bits past f.
        mask = [random.getrandbits(32) if w * 32 >= f else 0 for w in range(words_per_row)]
        for c in cols:
            mask[c // 32] |= 1 << (c % 32)
        if f % 32:
            mask[(f - 1) // 32] |= random.getrandbits(32) & ~((1 << (f % 32)) - 1)
        pairs, counts = walk(mask, words_per_row, f, tile // 32)
        assert pairs == cols, (f, tile, p, len(pairs), len(cols))
        n_tiles = (f + tile - 1) // tile
        assert counts == {t: sum(1 for c in cols if c // tile == t) for t in range(n_tiles)}
    # The sign kernel's mask (d_ff a multiple of 8, as its 16-byte loads need) is the
    # walk's layout: bit j % 32 of word j / 32, every word of the row written.
    for _ in range(rows):
        f = 8 * random.randint(1, 2100)
        words_per_row = (f + 127) // 128 * 4
        p = random.choice([0.0, 0.005, 0.03, 0.3, 1.0])
        positive = [random.random() < p for _ in range(f)]
        words = sign_mask_row(positive, f, words_per_row)
        assert all(w is not None for w in words), f
        assert [c for c in range(f) if words[c // 32] >> (c % 32) & 1] == [c for c in range(f) if positive[c]]
        pairs, _ = walk(words, words_per_row, f, 8)
        assert pairs == [c for c in range(f) if positive[c]]
    print(f"ok, {rows} rows walked, {rows} sign masks")


if __name__ == "__main__":
    main()
