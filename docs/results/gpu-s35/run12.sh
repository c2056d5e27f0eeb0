#!/bin/bash
# Session 35: ncu on the mask pack (the default from 4,096 rows) at 65,536 rows and 0.5%,
# where it takes about 0.15 ms: what holds it.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
X="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_requests_srcunit_tex.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum"
timeout 150 ncu --clock-control none --cache-control none -k 'regex:twell_gate_pack_mask' -c 1 $S $X /tmp/twell bench mlp --device cuda --dtype bf16 \
  --shape 2048x5632 --tokens 65536 --density 0.005 --reps 1 --warmup 0 > $OUT/ncu-mask-pack.log 2>&1
echo "rc $?"
grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit|Achieved Occ|Theoretical Occ|Registers Per|Warp Cycles Per Issued|Issued Ipc|Executed Instructions  |stalled_(long|barrier|mio|lg|wait|short|drain|membar|no_inst|branch)[a-z_]*_ratio|lts__t_(requests|sectors)|Waves Per SM|Grid Size|Block Limit" $OUT/ncu-mask-pack.log | head -40
