#!/bin/bash
# Session 35: ncu on the gate pack at 2,048 rows and 0.5% (11.5 µs for a 23 MB gate, about
# 2 TB/s): what holds it.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats"
X="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_requests_srcunit_tex.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,sm__cycles_active.avg,sm__cycles_active.max,gpu__time_duration.sum"
for cc in all none; do
timeout 120 ncu --clock-control none --cache-control $cc -k 'regex:twell_gate_pack' -c 1 $S $X /tmp/twell bench mlp --device cuda --dtype bf16 \
  --shape 2048x5632 --tokens 2048 --density 0.005 --reps 1 --warmup 0 > $OUT/ncu-pack-cache-$cc.log 2>&1
echo "== cache $cc rc $?"
grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit|Achieved Occ|Theoretical Occ|Registers Per|Warp Cycles Per Issued|stalled_(long|barrier|mio|lg|wait|short|drain|membar)[a-z_]*_ratio|lts__t_(requests|sectors)|sm__cycles_active|Waves Per SM|Grid Size|Block Size" $OUT/ncu-pack-cache-$cc.log | head -40
done
