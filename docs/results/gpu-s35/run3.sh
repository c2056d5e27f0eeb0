#!/bin/bash
# Session 35: ncu in full on the union up and down kernels (NB 256 and 128) and the row up
# and down kernels, 2,048 rows at 0.5%: stall reasons, L2 requests against sectors,
# shared-memory bank conflicts. Logs packed in one tarball (the device tool returns a few
# files a call).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=/tmp/r; mkdir -p $R
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
X="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_requests_srcunit_tex.sum,lts__t_sectors_srcunit_tex.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
B="bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048 --density 0.005 --reps 1 --warmup 0"
for nb in 256 128; do
  TWELL_PREFILL=union TWELL_UNION_BLOCK=$nb timeout 150 ncu --clock-control none -k 'regex:twell_union_(up|down)' -c 2 $S $X /tmp/twell $B > $R/ncu-union-$nb.log 2>&1
  echo "== ncu union $nb rc $?"
done
timeout 120 ncu --clock-control none -k 'regex:gated_t2d_(up|down)_rows' -c 2 $S $X /tmp/twell $B > $R/ncu-rows.log 2>&1
echo "== ncu rows rc $?"
for f in $R/ncu-union-256.log $R/ncu-rows.log; do
  grep -E "twell_union|gated_t2d|Duration|L2 Cache Throughput|Warp Cycles Per Issued|stalled_(long|barrier|mio|math|short|lg|wait|not_sel|dispatch|no_inst)[a-z_]*_per_issue_active.ratio|lts__t_(requests|sectors)|bank_conflicts|hmma" $f | head -60
done
tar -C $R -cJf $OUT/ncu-s35.tar.xz .
