#!/bin/bash
# Call 1 (session 25): unpack the build, keep part a of the default GGUF for the fine-tune
# calls, then check-gpu on the default build and with the lane-per-tile mask pack forced at
# every size, then the MLP stages with each mask pack, alternating.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
mkdir -p /tmp/assets && cp .device/s25/a/gguf.part-a /tmp/assets/
xz -dc -T4 .device/s25/a/twell.xz > /tmp/twell && chmod +x /tmp/twell
T=/tmp/twell; R=/tmp/r1; mkdir -p $R
timeout 120 $T check-gpu > $R/check-default.log 2>&1; echo "check default rc $?"; tail -1 $R/check-default.log
grep -v " ok$" $R/check-default.log | grep -v "^ *M \|^backward: " | head -8
TWELL_GATE=mask TWELL_MASK_PACK=lane timeout 120 $T check-gpu > $R/check-mask-lane.log 2>&1; echo "check mask lane rc $?"; tail -1 $R/check-mask-lane.log
grep -v " ok$" $R/check-mask-lane.log | grep -v "^ *M \|^backward: " | head -8
i=0; for p in warp lane warp lane; do i=$((i+1))
  TWELL_MASK_PACK=$p timeout 60 $T bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,8192,32768,65536 --density 0.005,0.01 --reps 7 --warmup 2 --stages > $R/stages-$p-$i.log 2>&1
  echo "== $p rc $?"; grep -E "^\s+2048\s+5632|stages" $R/stages-$p-$i.log | paste - - | awk '{printf "%s %s sp=%s %s | ",$3,$4,$8,$9; for(i=14;i<=NF;i++) printf "%s ", $i; print ""}'
done
tar cJf $OUT/call1.tar.xz -C $R .
