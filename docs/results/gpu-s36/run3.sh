#!/usr/bin/env bash
# Session 36: both packs' unit stepping through one helper (`unit_places` in
# kernels/gate_pack.cu; the mask pack's SASS is unchanged, the vector pack's has the same
# 584 instructions). check-gpu on the new build (.device/s36/g), then the pack stage of
# the previous build (.device/s36/e, be2a2c0) and the new one alternating, two rounds:
# 2,048 rows (the vector pack), 16,384 rows on the plain gate (vector) and the mask.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for v in e g; do xz -dc -T4 .device/s36/$v/twell.xz > /tmp/twell-$v && chmod +x /tmp/twell-$v; done
/tmp/twell-g check-gpu > $OUT/check.log 2>&1; tail -1 $OUT/check.log
for round in 1 2; do
  for v in e g; do
    for gate in plain mask; do
      echo "== build $v, TWELL_GATE=$gate, round $round" | tee -a $OUT/bench.log
      TWELL_GATE=$gate /tmp/twell-$v bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
        --tokens 2048,16384 --density 0.005,0.01 --reps 15 --warmup 3 --stages 2>&1 \
        | grep -E "^ +2048|stages" | tee -a $OUT/bench.log
    done
  done
done
