#!/bin/bash
# Session 31: the backward row kernels walk a token's pairs like the forward ones
# (`walk_row` on `walk_pairs`; `walk_tiles` removed). check-gpu, then the training step,
# the session's starting build (old) and this one (new).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
xz -dc -T4 .device/s31/gpu/twell-old.xz > /tmp/twell-old && chmod +x /tmp/twell-old
timeout 200 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep FAIL $OUT/check.log | head
for b in old new; do
  t=/tmp/twell; [ $b = old ] && t=/tmp/twell-old
  timeout 150 $t bench mlp-train --device cuda --tokens 2048,16384,65536 --density 0.005,0.01,0.03 \
    --reps 5 --json $OUT/train-$b.json > $OUT/train-$b.log 2>&1
  echo "== $b rc $?"; grep "2048   5632" $OUT/train-$b.log | awk '{print $3, $4, $6, $7, $8}' | tr '\n' ';'; echo
done
