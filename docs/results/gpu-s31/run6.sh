#!/bin/bash
# Session 31: which part of run5's change moves what. old: the session's start; A:
# walk_pairs alone; B: walk_pairs + the next row asked of L1 (run5's new); D: walk_pairs
# + the row two pairs ahead. The MLP at the bar sizes, the four builds in turn, two rounds.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for b in old A B D; do xz -dc -T4 .device/s31/gpu/twell-$b.xz > /tmp/twell-$b && chmod +x /tmp/twell-$b; done
for round in 1 2; do
  for b in old A B D; do
    timeout 100 /tmp/twell-$b bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384,65536 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mlp-$b-$round.log 2>&1
    echo "== $b round $round"; grep "2048   5632" $OUT/mlp-$b-$round.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
  done
done
