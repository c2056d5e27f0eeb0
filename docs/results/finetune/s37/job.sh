#!/usr/bin/env bash
# Session 37: the thirtieth session's best recipe (lr 2e-3, α 0.5 distilled from the
# original SiLU model, 8,192 sampled texts, gate-l0 with ε 0.3, the target read on the
# validation speeches at 2.9% and annealed over 1,600 steps, 3,000 steps, seed 0) with
# residual distillation added: β · the relative distance between the student's and the
# teacher's residual stream after each block (--distill-residual β, default BETA=1).
# With TWIN=1 the call runs the λ = 0 twin (same flags, --l1 0).
# Device flow: upload.sh a, upload.sh b, upload.sh d (the build), then
#   bash job.sh 480                  # samples, then the sparse run
#   TWIN=1 EVAL=1 bash job.sh 400    # the twin, then evaluates both (../s10/job-eval.sh)
# Each run resumes itself from its latest checkpoint until `final` exists. LIMIT (first
# argument) is each run's --time-limit.
set -u
limit=$1
. "$(dirname "$0")/../run-lib.sh"
prepare_job .device/s37/c
beta=${BETA:-1}
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-3000} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --distill-residual $beta --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples"
if [ "${TWIN:-0}" = 1 ]; then
  run relu-rd$beta-s37 --l1 0
else
  run tval-0.029-anneal1600-rd$beta --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 1600 \
    --l1-target-density 0.029 --l1-target-text validation --l1-gate-eps 0.3
fi
wait
pack_logs
if [ "${EVAL:-0}" = 1 ]; then BENCH=0 bash "$(dirname "$0")/../s10/job-eval.sh"; fi
