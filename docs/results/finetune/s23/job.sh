#!/usr/bin/env bash
# Call 3 of 4 (and 4 of 4, resuming): the thirteenth session's 2,000-step pair (lr 2e-3,
# α 0.5, gate-l0 annealed over 800 steps to 2.4%, and its λ = 0 twin) with texts sampled
# from the teacher added to the training text (`twell sample`, prompts from the training
# speeches only, `finetune --extra-data`). LIMIT (first argument) is each run's
# --time-limit; run again to resume. Held-out evaluation: ../s10/job-eval.sh (BENCH=0).
set -u
limit=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
if [ ! -x /tmp/twell ]; then
  cat /tmp/assets/gguf.part-a /tmp/assets/gguf.part-b .device/c/gguf.part-c > /tmp/assets/data/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/assets/data/SmolLM2-135M-Instruct.Q4_1.gguf   # a1231443440b107ff29f02bdb38c9d0a
  tar xJf .device/c/sotu.tar.xz -C /tmp/assets/data
  xz -dc .device/c/twell.xz > /tmp/twell && chmod +x /tmp/twell
fi
. "$(dirname "$0")/../run-lib.sh"
if [ "${SAMPLE:-1}" = 1 ] && [ ! -e /tmp/samples/done ]; then
  timeout ${SAMPLE_SECS:-200} $T sample --device cuda --count ${COUNT:-8192} --batch 256 \
    --prompt-tokens 32 --max-tokens 480 --temperature 0.8 --seed 0 --out /tmp/samples 2>&1 \
    | tr '\r' '\n' | tail -3
  touch /tmp/samples/done
  ls /tmp/samples | wc -l; du -sh /tmp/samples
  mkdir -p /tmp/pack && cp /tmp/samples/sample-00000[0-3].txt /tmp/pack/ 2>/dev/null
fi
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps 2000 --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples"
run relu-extra --l1 0
run t024-extra --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 800 --l1-target-density 0.024
wait
pack_logs
