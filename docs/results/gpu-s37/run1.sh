#!/usr/bin/env bash
# Session 37: one `PerKey` map for what the launchers keep (decode scratch per stream,
# driver values per context, cuBLASLt handles and workspaces per device), in place of
# three kinds of map. `check-gpu` on the new build (.device/s37/d), then the paths that
# read those maps, the previous build (.device/s36/g, main's kernels at 0a2d083) and the
# new one alternating, two rounds: the masked gate GEMM (cuBLASLt, from 4,096 rows), the
# one-token MLP (decode scratch) and a decode step of the 28-layer model (attention scratch).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s36/g/twell.xz > /tmp/twell-old && chmod +x /tmp/twell-old
xz -dc -T4 .device/s37/d/twell.xz > /tmp/twell-new && chmod +x /tmp/twell-new
/tmp/twell-new check-gpu > $OUT/check.log 2>&1; tail -1 $OUT/check.log
for round in 1 2; do
  for v in old new; do
    echo "== build $v, round $round" | tee -a $OUT/bench.log
    /tmp/twell-$v bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,16384 \
      --density 0.005,0.01 --reps 21 --warmup 3 2>&1 | tail -6 | tee -a $OUT/bench.log
    /tmp/twell-$v bench model --device cuda --dtype bf16 --shape 2048x5632x28 --decode-batch 1 \
      --prefill 1x512 --context 512 --decode-steps 32 --train "" --reps 3 --energy-secs 0 2>&1 | grep -E "^ +decode|enqueues" | tee -a $OUT/bench.log
  done
done
