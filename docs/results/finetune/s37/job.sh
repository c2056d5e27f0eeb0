#!/usr/bin/env bash
# Session 37: the thirtieth session's best recipe (lr 2e-3, α 0.5 distilled from the
# original SiLU model, 8,192 sampled texts, gate-l0 with ε 0.3, the target read on the
# validation speeches at 2.9% and annealed over 1,600 steps, 3,000 steps, seed 0, weight
# decay 0.1) with one change a variant, each variant's sparse run beside its λ = 0 twin
# (same flags, --l1 0). A variant is NAME=FLAGS (spaces in FLAGS as commas):
#   rd1=--distill-residual,1   residual distillation, β = 1 (the default variant)
#   rd3=--distill-residual,3   β = 3
#   wd0=--weight-decay,0       no weight decay (a variant's flag replaces the recipe's)
#   base=                      the recipe as it is (the thirtieth session's run again)
#   gw2=--relu-grad-window,0.2 the loss's gradient also reaches the gates within 0.2 of
#                              each layer's mean |gate| below zero (thirty-eighth session)
#   s-t298=--l1-target-density,0.0298   the sparse run aimed at 2.98%: a name starting
#                              with s- changes the sparse run only, runs no twin of its
#                              own, and is measured against base's twin
# Device flow: upload.sh a, upload.sh b, upload.sh d (the build), then on one GPU
#   bash job.sh 480                    # samples, then the sparse run of VARIANT (default rd1)
#   TWIN=1 EVAL=1 bash job.sh 400      # its twin, then evaluates both (../s10/job-eval.sh)
# or, on a machine of a GPU per run, every variant at once:
#   ALL=1 VARIANTS="rd1=--distill-residual,1 wd0=--weight-decay,0" EVAL=1 bash job.sh 420
# Each run resumes itself from its latest checkpoint until `final` exists (call again
# with the same flags). LIMIT (first argument) is each run's --time-limit.
set -u
limit=$1
. "$(dirname "$0")/../run-lib.sh"
prepare_job .device/s37/c
recipe="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-3000} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples"
sparse="--l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 1600 --l1-target-density 0.029 --l1-target-text validation --l1-gate-eps 0.3"
# with_variant NAME=FLAGS BASE: $common = the flags BASE with the variant's flags in place
# of BASE's own (each flag there takes one value).
with_variant() {
  local flags=${1#*=} kept=() skip=0 word
  flags=${flags//,/ }
  for word in $2; do
    if [ $skip = 1 ]; then skip=0; continue; fi
    case " $flags " in *" $word "*) [[ $word == --* ]] && { skip=1; continue; } ;; esac
    kept+=("$word")
  done
  common="${kept[*]} $flags"
}
# sparse_run / twin_run NAME=FLAGS
sparse_run() {
  with_variant "$1" "$recipe $sparse"
  run tval-0.029-anneal1600-${1%%=*}
}
twin_run() {
  with_variant "$1" "$recipe"
  run relu-${1%%=*}-s37 --l1 0
}
if [ "${ALL:-0}" = 1 ]; then
  gpu=0
  for variant in ${VARIANTS:-rd1=--distill-residual,1}; do
    GPU=$gpu sparse_run "$variant"; gpu=$((gpu + 1))
    [[ $variant == s-* ]] && continue
    GPU=$gpu twin_run "$variant"; gpu=$((gpu + 1))
  done
elif [ "${TWIN:-0}" = 1 ]; then
  variant=${VARIANT:-rd1=--distill-residual,1}
  [[ $variant == s-* ]] && { echo "$variant changes the sparse run only: its twin is base's"; exit 1; }
  twin_run "$variant"
else
  sparse_run "${VARIANT:-rd1=--distill-residual,1}"
fi
wait
pack_logs
if [ "${EVAL:-0}" = 1 ]; then BENCH=0 bash "$(dirname "$0")/../s10/job-eval.sh"; fi
