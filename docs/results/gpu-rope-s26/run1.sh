#!/bin/bash
# Call 1 (session 26): check-gpu on this build with each prefill attention kernel, then
# the 28-layer prefill at 16 x 2048 with the prefill's RoPE taken each way named as an
# argument (TWELL_PREFILL_ROPE: all, keys, in-place), one process each, in that order.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s26/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=$OUT  # written there as they finish: a call cut short still returns them
if [ "${CHECK:-1}" = 1 ]; then
  timeout 150 /tmp/twell check-gpu > $R/check.log 2>&1; rc=$?; echo "check rc $rc"; tail -1 $R/check.log
  grep "turning q" $R/check.log | head -3; grep -v " ok$" $R/check.log | grep -v "^ *M \|^backward: " | head -8
  TWELL_ATTENTION=mma timeout 150 /tmp/twell check-gpu > $R/check-mma.log 2>&1; rc2=$?; echo "check mma rc $rc2"; tail -1 $R/check-mma.log
  grep -v " ok$" $R/check-mma.log | grep -v "^ *M \|^backward: " | head -8
  [ $rc = 0 ] && [ $rc2 = 0 ] || exit 1
fi
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
i=0; for p in "$@"; do i=$((i+1))
  s=$(date +%s)
  TWELL_PREFILL_ROPE=$p timeout 120 /tmp/twell bench model $MODEL --prefill 16x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/model-${TAG:-a}$i-$p.log 2>&1
  echo "== $p rc $? $(( $(date +%s) - s )) s"; grep -E "prefill|decode " $R/model-${TAG:-a}$i-$p.log
done
