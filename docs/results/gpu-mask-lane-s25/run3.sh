#!/bin/bash
# Call 6 (session 25): the attention that turns q itself. check-gpu on the new build with
# each prefill attention kernel, then the 28-layer prefill, the build before (old) and
# this one (new) alternating, one process each.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for b in old new; do xz -dc -T4 .device/s25/d/twell-$b.xz > /tmp/twell-$b && chmod +x /tmp/twell-$b; done
R=$OUT  # written there as they finish: a call cut short still returns them
timeout 120 /tmp/twell-new check-gpu > $R/check-new.log 2>&1; rc=$?; echo "check new rc $rc"; tail -1 $R/check-new.log
grep "turning q" $R/check-new.log; grep -v " ok$" $R/check-new.log | grep -v "^ *M \|^backward: " | head -8
TWELL_ATTENTION=mma timeout 120 /tmp/twell-new check-gpu > $R/check-new-mma.log 2>&1; rc2=$?; echo "check new mma rc $rc2"; tail -1 $R/check-new-mma.log
grep "turning q" $R/check-new-mma.log; grep -v " ok$" $R/check-new-mma.log | grep -v "^ *M \|^backward: " | head -8
if [ $rc = 0 ] && [ $rc2 = 0 ]; then
  MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
  i=0; for b in new old; do i=$((i+1))
    timeout 110 /tmp/twell-$b bench model $MODEL --prefill 4x2048,16x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/model-$i-$b.log 2>&1
    echo "== $b rc $?"; grep -E "prefill|decode " $R/model-$i-$b.log
  done
fi
