#!/usr/bin/env bash
# Session 33: the thirtieth session's better recipe (lr 2e-3, α 0.5, 3,000 steps, 8,192
# sampled texts, seed 0, gate-l0 with ε 0.3, the target read on the validation speeches
# at 2.9%, annealed over ANNEAL steps, default 1,600) with MLP biases (--mlp-bias: zero
# at the start, no weight decay), the λ = 0 twin with them too (TWIN=1).
# Device flow: upload.sh a (with the build), upload.sh b, then this with part c and the
# corpus carried; LIMIT (first argument) is the run's --time-limit; EVAL=1 evaluates
# every finished run (../s10/job-eval.sh, BENCH=0, dense FFN: the TwELL kernels apply no
# biases).
set -u
limit=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/../run-lib.sh"
assemble_assets .device/s33/c
sample_once
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-3000} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples --mlp-bias"
if [ "${TWIN:-0}" = 1 ]; then
  run relu-bias-s33 --l1 0
else
  run bias-tval-0.029-eps0.3-anneal${ANNEAL:-1600} --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 \
    --l1-target-anneal ${ANNEAL:-1600} --l1-target-density 0.029 --l1-target-text validation --l1-gate-eps 0.3
fi
wait
pack_logs
if [ "${EVAL:-0}" = 1 ]; then BENCH=0 GEN_FFN=dense bash "$(dirname "$0")/../s10/job-eval.sh"; fi
