#!/usr/bin/env bash
# Session 32: the thirtieth session's better run (lr 2e-3, α 0.5, 3,000 steps, 8,192
# sampled texts, seed 0, gate-l0 with ε 0.3, the target read on the validation speeches
# at 2.9%) with the target annealed over ANNEAL steps (default 2,200; s30: 800 → 1.161,
# 1,600 → 1.150). The session's build samples other texts than s30's (the prefill row
# kernels changed in s31), so the λ = 0 twin is trained again (TWIN=1).
# Device flow: upload.sh a (with the build), upload.sh b, then this with part c and the
# corpus carried; LIMIT (first argument) is the run's --time-limit; EVAL=1 evaluates
# every finished run (../s10/job-eval.sh, BENCH=0).
set -u
limit=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/../run-lib.sh"
assemble_assets .device/s32/c
sample_once
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-3000} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples"
if [ "${TWIN:-0}" = 1 ]; then
  run relu-s32 --l1 0
else
  run tval-0.029-eps0.3-anneal${ANNEAL:-2200} --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 \
    --l1-target-anneal ${ANNEAL:-2200} --l1-target-density 0.029 --l1-target-text validation --l1-gate-eps 0.3
fi
wait
pack_logs
if [ "${EVAL:-0}" = 1 ]; then BENCH=0 bash "$(dirname "$0")/../s10/job-eval.sh"; fi
