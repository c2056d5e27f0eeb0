#!/bin/bash
# Session 35: (1) ncu on the union up and down kernels (NB 256) and on the row up and down
# kernels at 2,048 rows and 0.5%, to see why the union kernels run at half the model's
# rate; (2) the work-item up kernel (docs/results/gpu-s33/up-items-v2.diff, built as
# .device/items/twell.xz): check-gpu on its default path and with items of 4 parts, then
# the up stage at 2,048 and 16,384 rows with items off, 1 and 4.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
xz -dc -T4 .device/items/twell.xz > /tmp/twell-items && chmod +x /tmp/twell-items
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
B="bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048 --density 0.005 --reps 1 --warmup 0"
TWELL_PREFILL=union TWELL_UNION_BLOCK=256 timeout 120 ncu --clock-control none -k 'regex:twell_union_(up|down|bits|list)' -c 4 $S /tmp/twell $B > $OUT/ncu-union.log 2>&1
echo "== ncu union rc $?"; grep -E "twell_union|Duration|Throughput|Issued Ipc|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Theoretical Occ|L2 Hit|Block Limit" $OUT/ncu-union.log | head -70
timeout 100 ncu --clock-control none -k 'regex:gated_t2d_(up|down)_rows' -c 2 $S /tmp/twell $B > $OUT/ncu-rows.log 2>&1
echo "== ncu rows rc $?"; grep -E "gated_t2d|Duration|Throughput|Warp Cycles Per Issued|Achieved Occupancy|L2 Hit" $OUT/ncu-rows.log | head -30
timeout 150 /tmp/twell-items check-gpu > $OUT/check-items-off.log 2>&1
echo "check items-off rc $?"; tail -1 $OUT/check-items-off.log
TWELL_UP_ITEMS=4 timeout 150 /tmp/twell-items check-gpu > $OUT/check-items4.log 2>&1
echo "check items 4 rc $?"; tail -1 $OUT/check-items4.log; grep -i "FAIL" $OUT/check-items4.log | head -5
for round in 1 2; do
  for p in off 1 4; do
    if [ $p = off ]; then unset TWELL_UP_ITEMS; else export TWELL_UP_ITEMS=$p; fi
    timeout 40 /tmp/twell-items bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384 \
      --density 0.005,0.01 --reps 11 --warmup 3 --stages > $OUT/mlp-items-$p-$round.log 2>&1
    echo "== items $p round $round"; grep -E "stages" $OUT/mlp-items-$p-$round.log | head -4
  done
done
# The union kernels at NB 256 once more (run1's logs of them did not come back).
TWELL_PREFILL=union TWELL_UNION_BLOCK=256 timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
  --tokens 2048,16384 --density 0.005,0.01,0.03 --reps 11 --warmup 3 --stages > $OUT/mlp-union-256.log 2>&1
echo "== union-256 rc $?"; grep -E "stages" $OUT/mlp-union-256.log | head -6
