#!/bin/bash
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
mkdir -p /tmp/b && xz -dc -T4 .device/s24/twell.xz > /tmp/b/twell && chmod +x /tmp/b/twell
T=/tmp/b/twell
R=$OUT/r; mkdir -p $R
for g in mask plain; do
TWELL_GATE=$g timeout 200 $T check-gpu > $R/check-$g.log 2>&1; echo "check $g rc $?"; tail -1 $R/check-$g.log; grep -v " ok$" $R/check-$g.log | grep -v "^ *M \|^backward: " | head -10
done
for g in plain mask plain mask; do
  TWELL_GATE=$g timeout 100 $T bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,8192,16384,65536 --density 0.005,0.01 --reps 7 --warmup 2 --stages > $R/stages-$g.log 2>&1
  echo "== $g rc $?"; grep -E "^\s+2048\s+5632|stages|candidates" $R/stages-$g.log | paste - - | awk '{print $3,$4,$7,$8,$9, $15,$17,$19,$21,$23,$25,$27}'
  grep candidates $R/stages-$g.log | head -4
done
