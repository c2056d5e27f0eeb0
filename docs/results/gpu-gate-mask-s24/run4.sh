#!/bin/bash
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
mkdir -p /tmp/b4 && xz -dc -T4 .device/s24/twell.xz > /tmp/b4/twell && chmod +x /tmp/b4/twell
T=/tmp/b4/twell
R=$OUT/r; mkdir -p $R
timeout 100 $T check-gpu > $R/check-mask.log 2>&1; echo "check rc $?"; tail -1 $R/check-mask.log; grep -v " ok$" $R/check-mask.log | grep -v "^ *M \|^backward: " | head -10
TWELL_GATE=mask timeout 60 ncu --clock-control none -k regex:twell_gate_pack -s 2 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section Occupancy --section LaunchStats $T bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 8192 --density 0.005 --reps 1 --warmup 1 > $R/ncu-mask.txt 2>&1
grep -E "Duration|DRAM Throughput|Issued Warp|Registers Per|Achieved Occ" $R/ncu-mask.txt
for g in plain mask; do
  TWELL_GATE=$g timeout 60 $T bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,8192,32768,65536 --density 0.005,0.01 --reps 7 --warmup 2 --stages > $R/stages-$g.log 2>&1
  echo "== $g"; grep -E "^\s+2048\s+5632|stages" $R/stages-$g.log | paste - - | awk '{printf "%s %s sp=%s %s | ",$3,$4,$8,$9; for(i=14;i<=NF;i++) printf "%s ", $i; print ""}'
done
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
for g in mask plain mask plain; do
  TWELL_GATE=$g timeout 120 $T bench model $MODEL --prefill 4x2048,16x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/model-$g-$(date +%s).log 2>&1
  echo "== $g rc $?"; ls -t $R/model-$g-*.log | head -1 | xargs grep -E "prefill"
done
