#!/usr/bin/env bash
# Session 36: the two-stage recipe (run; results in docs/results.md, "Thirty-sixth
# session"). Every run so far sparsified while it was still recovering from the ReLU
# conversion (held-out perplexity 4,044 at step 0). Here the sparse run and its λ = 0 twin
# both start from one plain ReLU fine-tune (stage 1, λ = 0, STAGE1 steps, default 1,000),
# then train STAGE2 more steps (default 2,000) from it with the thirtieth session's better
# recipe (lr 2e-3, α 0.5 distilled from the original SiLU model, 8,192 sampled texts,
# gate-l0 with ε 0.3, the target read on the validation speeches at 2.9%, annealed over
# ANNEAL steps, default 1,000). Both get the same 3,000 steps in all and the same learning
# rate restart, so the twin is the same recipe with λ = 0.
# Device flow: upload.sh a, upload.sh b, upload.sh d (the build), then
#   STAGE=1 bash job.sh 400           # samples, then stage 1 (about 100 s alone)
#   bash job.sh 430; TWIN=1 bash job.sh 430   # each resumes itself until `final` exists
#   EVAL=1 ... on the last call evaluates every finished run (../s10/job-eval.sh).
# LIMIT (first argument) is each run's --time-limit.
set -u
limit=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/../run-lib.sh"
assemble_assets .device/s36/c
sample_once
gguf=$TWELL_DATA/SmolLM2-135M-Instruct.Q4_1.gguf
recipe="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --lr 2e-3 --extra-data /tmp/samples"
if [ "${STAGE:-2}" = 1 ]; then
  common="$recipe --steps ${STAGE1:-1000} --seed 0"
  run relu-stage1-s36 --l1 0
else
  [ -d $out/relu-stage1-s36/final ] || { echo "stage 1 has no final checkpoint yet"; exit 1; }
  # The student starts from stage 1; the teacher stays the original model, and a new seed
  # gives stage 2 another order of the training sequences than stage 1's first steps.
  common="$recipe --steps ${STAGE2:-2000} --seed 1 --model $out/relu-stage1-s36/final --teacher $gguf"
  if [ "${TWIN:-0}" = 1 ]; then
    run relu-two-stage-s36 --l1 0
  else
    run two-stage-tval-0.029-anneal${ANNEAL:-1000} --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 \
      --l1-target-anneal ${ANNEAL:-1000} --l1-target-density 0.029 --l1-target-text validation --l1-gate-eps 0.3
  fi
fi
wait
pack_logs
if [ "${EVAL:-0}" = 1 ]; then BENCH=0 bash "$(dirname "$0")/../s10/job-eval.sh"; fi
