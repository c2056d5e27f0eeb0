#!/usr/bin/env bash
# Session 25: the twenty-third session's pair (lr 2e-3, α 0.5, gate-l0 annealed over 800
# steps, and its λ = 0 twin) on more sampled text (the draws now on the device) and a
# longer schedule, STEPS (default 3,000), the target density 2.35% (held-out L0 landed a
# hair over 46 at 2.4%). Parts a and b of the GGUF were left in /tmp/assets by the calls
# before; this call carries part c, the corpus and nothing else. LIMIT (first argument) is
# each run's --time-limit; run again with SAMPLE=0 to resume. Held-out evaluation:
# ../s10/job-eval.sh (BENCH=0).
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
  start=$(date +%s)
  timeout ${SAMPLE_SECS:-200} $T sample --device cuda --count ${COUNT:-8192} --batch 256 \
    --prompt-tokens 32 --max-tokens 480 --temperature 0.8 --seed 0 --out /tmp/samples 2>&1 \
    | tr '\r' '\n' | tail -3
  touch /tmp/samples/done
  echo "sampled for $(( $(date +%s) - start )) s: $(ls /tmp/samples | wc -l) files, $(cat /tmp/samples/*.txt | wc -w) words"
  du -sh /tmp/samples
  mkdir -p /tmp/pack && cp /tmp/samples/sample-00000[0-3].txt /tmp/pack/ 2>/dev/null
fi
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-3000} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed 0 --lr 2e-3 --extra-data /tmp/samples"
run relu-s25 --l1 0
run t0235-s25 --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 800 --l1-target-density 0.0235
wait
pack_logs
