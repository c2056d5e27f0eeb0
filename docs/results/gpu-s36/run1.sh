#!/usr/bin/env bash
# Session 36: the per-stream scratch helper (`cuda::per_stream`, used by the decode MLP
# and the decode attention step): `check-gpu` on the new build, then the one-token MLP
# and a decode step of the 28-layer model, the previous build (.device/s36/d, 01c4ec0)
# and the new one (.device/s36/e) alternating, two rounds.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for v in d e; do xz -dc -T4 .device/s36/$v/twell.xz > /tmp/twell-$v && chmod +x /tmp/twell-$v; done
/tmp/twell-e check-gpu > $OUT/check.log 2>&1; tail -1 $OUT/check.log
for round in 1 2; do
  for v in d e; do
    echo "== build $v, round $round" | tee -a $OUT/bench.log
    /tmp/twell-$v bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1 \
      --density 0.005,0.01,0.03 --reps 31 --warmup 5 2>&1 | tail -4 | tee -a $OUT/bench.log
    /tmp/twell-$v bench model --device cuda --dtype bf16 --shape 2048x5632x28 --decode-batch 1 \
      --prefill 1x512 --context 512 --decode-steps 32 --train "" --reps 3 --energy-secs 0 2>&1 | grep -E "^ +decode|enqueues" | tee -a $OUT/bench.log
  done
done
