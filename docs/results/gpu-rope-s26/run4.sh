#!/bin/bash
# Call 4 (session 26): check-gpu with each prefill attention kernel on the final build (the
# masked gate GEMM's plan now owns and destroys its cuBLASLt objects), then the 28-layer
# prefill at 4 x 2048, 16 x 2048 and 64 x 2048 on the default way, one process.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s26/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=$OUT
timeout 150 /tmp/twell check-gpu > $R/final-check.log 2>&1; rc=$?; echo "check rc $rc"; tail -1 $R/final-check.log
grep -v " ok$" $R/final-check.log | grep -v "^ *M \|^backward: " | head -8
TWELL_ATTENTION=mma timeout 150 /tmp/twell check-gpu > $R/final-check-mma.log 2>&1; rc2=$?; echo "check mma rc $rc2"; tail -1 $R/final-check-mma.log
[ $rc = 0 ] && [ $rc2 = 0 ] || exit 1
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
s=$(date +%s)
timeout 200 /tmp/twell bench model $MODEL --prefill 4x2048,16x2048,64x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 --json $R/final-model.json > $R/final-model.log 2>&1
echo "== model rc $? $(( $(date +%s) - s )) s"; grep -E "prefill|decode " $R/final-model.log
