#!/bin/bash
# Session 31: the prefill row kernels walk a token's pairs across tiles in blocks of 32
# (`walk_pairs`) and ask L1 for the next neuron's weight row while they work on this one
# (`prefetch.global.L1`). check-gpu on the new build, then the MLP at the bar sizes, the
# previous build (twell-old, the session's start) and the new one alternating, two rounds.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
xz -dc -T4 .device/s31/gpu/twell-old.xz > /tmp/twell-old && chmod +x /tmp/twell-old
timeout 200 /tmp/twell check-gpu > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep FAIL $OUT/check.log | head
for round in 1 2; do
  for b in old new; do
    t=/tmp/twell; [ $b = old ] && t=/tmp/twell-old
    timeout 100 $t bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384,65536 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 --json $OUT/mlp-$b-$round.json > $OUT/mlp-$b-$round.log 2>&1
    echo "== $b round $round"; grep "2048   5632" $OUT/mlp-$b-$round.log
  done
done
