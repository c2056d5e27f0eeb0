#!/bin/bash
# Session 31: where the column down kernel's time goes: --stages for both down kernels at
# M = 16384, and ncu on the list and column kernels (and the row down kernel) at 1%.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
for k in rows cols; do
  TWELL_DOWN=$k timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
    --tokens 16384 --density 0.005,0.01 --reps 7 --warmup 2 --stages > $OUT/stages-$k.log 2>&1
  echo "== $k"; grep -i "stage\|2048   5632" $OUT/stages-$k.log | head
done
for k in rows cols; do
  TWELL_DOWN=$k timeout 150 ncu --clock-control none -k 'regex:gated_t2d_(cols|down_rows)' -c 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 16384 --density 0.01 --reps 1 --warmup 0 > $OUT/ncu-$k.log 2>&1
  echo "== ncu $k rc $?"; grep -E "gated_t2d|Duration|Throughput|Issued Ipc|No Eligible|Bank|Warp Cycles Per Issued|Achieved Occupancy|Registers|Stall" $OUT/ncu-$k.log | head -60
done
