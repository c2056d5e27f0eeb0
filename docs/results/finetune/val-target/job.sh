#!/usr/bin/env bash
# The twenty-fifth session's gate-l0 run (lr 2e-3, α 0.5, annealed over 800 steps, the
# same sampled text) with its target density read on the validation split
# (--l1-target-text validation, prepared in the twenty-sixth session): TARGET (default
# 0.029) is the density aimed at on real text, where the 2.35% training target of
# s25 landed at 3.05%. Its λ = 0 twin is s25's relu-s25 (held-out 28.23): the target
# flags do not reach a λ = 0 run. Device flow as s25/job.sh: parts a and b of the GGUF
# left in /tmp/assets by the calls before, part c and the corpus carried here; LIMIT
# (first argument) is the run's --time-limit; run again with SAMPLE=0 to resume.
# Held-out evaluation: ../s10/job-eval.sh (BENCH=0); table: ../heldout_steps.py.
set -u
limit=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
if [ ! -e /tmp/assets/data/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/assets/data
  cat /tmp/assets/gguf.part-a /tmp/assets/gguf.part-b .device/s25/c/gguf.part-c > /tmp/assets/data/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/assets/data/SmolLM2-135M-Instruct.Q4_1.gguf   # a1231443440b107ff29f02bdb38c9d0a
  tar xJf .device/s25/c/sotu.tar.xz -C /tmp/assets/data
fi
. "$(dirname "$0")/../run-lib.sh"
if [ "${SAMPLE:-1}" = 1 ] && [ ! -e /tmp/samples/done ]; then
  timeout ${SAMPLE_SECS:-200} $T sample --device cuda --count ${COUNT:-8192} --batch 256 \
    --prompt-tokens 32 --max-tokens 480 --temperature 0.8 --seed 0 --out /tmp/samples 2>&1 \
    | tr '\r' '\n' | tail -3
  touch /tmp/samples/done
fi
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-3000} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples"
run tval-${TARGET:-0.029} --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 800 --l1-target-density ${TARGET:-0.029} --l1-target-text validation
wait
pack_logs
