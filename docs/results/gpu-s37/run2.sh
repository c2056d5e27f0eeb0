#!/usr/bin/env bash
# Session 37 (for the next device): does a better-balanced GEMM algorithm speed the gate?
# 2,048 x 5,632 in output tiles of 128 x 256, for one, is 2.7 waves of the H200's 132 SMs.
# `TWELL_GATE=lt` takes the plain gate through cuBLASLt's fastest of its timed candidates
# (TWELL_GATE_CANDIDATES, default 8) instead of `cublasGemmEx` (`--stages` also prints each
# plan's candidate times). Runs `check-gpu` with the knob, then the stages, the default and
# `lt` alternating, two rounds; then the default masked gate from 8 and from 32 candidates.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s37/d/twell.xz > /tmp/twell && chmod +x /tmp/twell
TWELL_GATE=lt /tmp/twell check-gpu > $OUT/check-lt.log 2>&1; tail -1 $OUT/check-lt.log
bench() {
  /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens "$1" \
    --density 0.005,0.01 --reps 11 --warmup 3 --stages 2>&1
}
for round in 1 2; do
  for gate in default lt; do
    echo "== gate $gate, round $round" | tee -a $OUT/bench.log
    if [ $gate = lt ]; then export TWELL_GATE=lt; else unset TWELL_GATE; fi
    bench 2048,4096,16384 | tee -a $OUT/bench.log | tail -14
  done
done
unset TWELL_GATE
for round in 1 2; do
  for n in 8 32; do
    echo "== mask gate, $n candidates, round $round" | tee -a $OUT/bench.log
    TWELL_GATE_CANDIDATES=$n bench 16384,65536 | tee -a $OUT/bench.log | tail -10
  done
done
