#!/usr/bin/env bash
# Session 36: the up row kernel with the neurons' rows copied two ahead into shared
# memory (`TWELL_UP_ASYNC=1`, an experiment). check-gpu with it on, then the MLP bench with
# it off and on alternating, two rounds, with the stages.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s36/f/twell.xz > /tmp/twell-f && chmod +x /tmp/twell-f
TWELL_UP_ASYNC=1 /tmp/twell-f check-gpu > $OUT/check-async.log 2>&1; tail -1 $OUT/check-async.log
grep -iE "fail" $OUT/check-async.log | head -5
for round in 1 2; do
  for a in 0 1; do
    echo "== TWELL_UP_ASYNC=$a, round $round" | tee -a $OUT/bench.log
    TWELL_UP_ASYNC=$a /tmp/twell-f bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048,16384 --density 0.005,0.01,0.03 --reps 15 --warmup 3 --stages 2>&1 \
      | grep -E "^ +2048|stages" | tee -a $OUT/bench.log
  done
done
