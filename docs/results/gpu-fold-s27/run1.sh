#!/bin/bash
# Call 1 (session 27): check-gpu on this build (the MLP with the norm before it folded,
# the output projection added into the residual in place, and the model with its MLP
# norms folded), then the 28-layer prefill with the MLP norms folded or not
# (TWELL_FOLD_NORMS=1|0, named as arguments), one process each, in the order given.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s27/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=$OUT  # written there as they finish: a call cut short still returns them
if [ "${CHECK:-1}" = 1 ]; then
  timeout 150 /tmp/twell check-gpu > $R/check.log 2>&1; rc=$?; echo "check rc $rc"; tail -1 $R/check.log
  grep -E "folded|in place|model \(" $R/check.log
  grep -v " ok$" $R/check.log | grep -v "^ *M \|^backward: " | head -8
  [ $rc = 0 ] || [ "${FORCE:-0}" = 1 ] || exit 1
fi
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
i=0; for p in "$@"; do i=$((i+1))
  s=$(date +%s)
  TWELL_FOLD_NORMS=$p timeout 150 /tmp/twell bench model $MODEL --prefill ${PREFILL:-16x2048} --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/model-${TAG:-a}$i-fold$p.log 2>&1
  echo "== fold $p rc $? $(( $(date +%s) - s )) s"; grep -E "prefill|decode " $R/model-${TAG:-a}$i-fold$p.log
done
