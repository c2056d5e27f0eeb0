#!/usr/bin/env bash
# Session 38 (for the next device; carry .device/s36/g and .device/s38/d). The build
# .device/s38/d (this session's HEAD, stripped) holds changes not yet run on a GPU:
#   - session 37's `PerKey` maps (decode scratch, driver values, cuBLASLt plans);
#   - the pack, up and down launched through `launch::Args` (`cuLaunchKernelEx`) on every
#     path, and the MLP's output buffer made before the gate GEMM;
#   - `TWELL_OVERLAP=on`: those launches overlapped (programmatic dependent launch);
#   - `TWELL_MASK_ROWS=on`: the up and down row kernels walk a bit mask of the gate instead
#     of TwELL slots: cuBLASLt's mask from 4,096 rows (no pack), below it one made from the
#     plain gate by `twell_gate_sign_mask_bf16` in place of the pack.
# First `check-gpu` three ways: the whole suite on the default path; the MLP forward checks
# (--mlp-only) with both knobs and cuBLASLt's mask forced at every prefill size, and with
# both knobs and the sign kernel's mask forced at every prefill size (a warp a row forced
# in both, so 65 to 1,024 rows take the new kernels too). Then the
# whole MLP unprofiled (the overlap is off under --stages): old build (.device/s36/g,
# 0a2d083) / new / overlap / mask rows / mask rows + overlap alternating, two rounds, at
# 2,048 to 65,536 rows; eight layers a call (--chain 8) at 2,048 rows, new and mask rows +
# overlap, two rounds; the stages with and without mask rows; a decode step old / new.
# Leaves /tmp/twell (the new build) for the fine-tune job, which can then skip
# `upload.sh d` while the machine is warm. run2.sh holds the lower-priority rest.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/lib.sh"
xz -dc -T8 .device/s36/g/twell.xz > /tmp/twell-old &
xz -dc -T8 .device/s38/d/twell.xz > /tmp/twell-new
wait
chmod +x /tmp/twell-old /tmp/twell-new && cp /tmp/twell-new /tmp/twell
stamp "unpacked"
check default
check new-lt-mask --mlp-only TWELL_OVERLAP=on TWELL_MASK_ROWS=on TWELL_ROW_SPLIT=1 TWELL_GATE=mask
check new-sign-mask --mlp-only TWELL_OVERLAP=on TWELL_MASK_ROWS=on TWELL_ROW_SPLIT=1 TWELL_GATE=plain
# mlp BIN NAME EXTRA [KNOB=VALUE...]: the MLP bench, its table's rows printed.
mlp() {
  local bin=$1 name=$2 extra=$3
  shift 3
  env "$@" timeout 120 /tmp/twell-$bin bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
    --density 0.005,0.01,0.03 --reps 15 --warmup 3 $extra > "$OUT/$name.log" 2>&1
  stamp "== $name (rc $?): M target dense sparse speedup auto"
  grep -E "^ +2048 +5632" "$OUT/$name.log" | awk '{print $3, $4, $7, $8, $9, $10}'
}
sizes="--tokens 2048,4096,16384,65536"
for round in 1 2; do
  mlp old mlp-old-$round "$sizes"
  mlp new mlp-new-$round "$sizes"
  mlp new mlp-overlap-$round "$sizes" TWELL_OVERLAP=on
  mlp new mlp-mask-rows-$round "$sizes" TWELL_MASK_ROWS=on
  mlp new mlp-mask-rows-overlap-$round "$sizes" TWELL_MASK_ROWS=on TWELL_OVERLAP=on
done
# Eight layers back to back a timed call (each on its own weights), as a model runs them:
# the per-call launch and sync (about 20 µs either side, thirty-fifth session) is paid
# once per eight layers, so the ratio nears the GPU's own (ncu: 1.74x at 2,048 rows, 0.5%).
chain="--tokens 2048 --chain 8 --weight-sets 8"
for round in 1 2; do
  mlp new chain8-new-$round "$chain"
  mlp new chain8-mask-rows-overlap-$round "$chain" TWELL_MASK_ROWS=on TWELL_OVERLAP=on
done
mlp new stages-new "--tokens 2048,16384 --stages"
mlp new stages-mask-rows "--tokens 2048,16384 --stages" TWELL_MASK_ROWS=on
grep -h "stages" "$OUT/stages-new.log" "$OUT/stages-mask-rows.log"
for v in old new; do
  timeout 120 /tmp/twell-$v bench model --device cuda --dtype bf16 --shape 2048x5632x28 \
    --decode-batch 1 --prefill 1x512 --context 512 --decode-steps 32 --train "" --reps 3 \
    --energy-secs 0 > "$OUT/decode-$v.log" 2>&1
  stamp "== decode step, build $v (rc $?)"
  grep -E "^ +decode|enqueues" "$OUT/decode-$v.log"
done
stamp "done"
