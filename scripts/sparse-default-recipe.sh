#!/usr/bin/env bash
# How the shipped sparse default model (models/smollm2-135m-sparse) is made, on one GPU:
# the default SmolLM2-135M-Instruct GGUF with its MLP gate switched to ReLU; its gate and
# up projections trained whole (shipped as Q4_0 deltas), the other projections through
# rank-16 LoRA factors with row scales, embeddings and norms frozen; the gate-count
# penalty steered to a target FFN density; distilled from the original model. Then
# `twell eval` of it and of the dense original on the held-out speeches, and their
# perplexity ratio (docs/finetuning.md, "The sparse default model").
#   scripts/sparse-default-recipe.sh OUTDIR
# Needs a CUDA build of `twell` (TWELL names it; default: twell on PATH) and the assets of
# scripts/setup.sh. RANK, FULL (modules trained whole), TARGET (density), STEPS, ANNEAL,
# DISTILL, CHAT_TEXTS, SPEECH_TEXTS and TIME_LIMIT (seconds) override the recipe's values;
# the shipped adapter came from STEPS=2000 ANNEAL=1000 TIME_LIMIT=270 TARGET=0.05.
# The adapter lands in OUTDIR/run/final/adapter (or the last step-N's, at the time limit).
set -euo pipefail

out=${1:?usage: sparse-default-recipe.sh OUTDIR}
twell=${TWELL:-twell}
rank=${RANK:-16}
full=${FULL:-gate_proj,up_proj}
target=${TARGET:-0.04}
steps=${STEPS:-2600}
anneal=${ANNEAL:-1400}
time_limit=${TIME_LIMIT:-420}
distill=${DISTILL:-0.8}
chat_texts=${CHAT_TEXTS:-8192}
speech_texts=${SPEECH_TEXTS:-2048}
mkdir -p "$out/samples"

# Training text beyond the speeches: continuations of speech windows, and whole chat
# exchanges (user message and reply), both written by the original model, so that the
# distilled student keeps its chat behaviour as well as its prose.
if [ ! -e "$out/samples/.speeches" ]; then
  "$twell" sample --device cuda --count "$speech_texts" --batch 256 --prompt-tokens 32 \
    --max-tokens 480 --temperature 0.8 --seed 0 --out "$out/samples-speeches"
  for f in "$out"/samples-speeches/*.txt; do mv "$f" "$out/samples/speech-${f##*/}"; done
  touch "$out/samples/.speeches"
fi
if [ ! -e "$out/samples/.chat" ]; then
  "$twell" sample --device cuda --chat --count "$chat_texts" --batch 256 --max-tokens 480 \
    --temperature 0.8 --seed 1 --out "$out/samples-chat"
  for f in "$out"/samples-chat/*.txt; do mv "$f" "$out/samples/chat-${f##*/}"; done
  touch "$out/samples/.chat"
fi

"$twell" finetune --device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 \
  --steps "$steps" --lr 2e-3 --warmup 20 --weight-decay 0.1 --distill "$distill" \
  --extra-data "$out/samples/*.txt" --seed 0 --eval-every 100 --eval-batches 8 \
  --time-limit "$time_limit" --l1 2e-3 --l1-warmup 50 --penalty gate-l0 \
  --l1-target-density "$target" --l1-target-anneal "$anneal" --l1-target-text validation \
  --lora-rank "$rank" --lora-full "$full" --out "$out/run"

final=$out/run/final
[ -d "$final" ] || final=$(ls -d "$out"/run/step-* | sort -V | tail -1)
"$twell" eval --device cuda --model "$final" --last 10 --json "$out/eval-sparse.json" \
  >"$out/eval-sparse.log" 2>&1
"$twell" eval --device cuda --dense --last 10 --json "$out/eval-dense.json" \
  >"$out/eval-dense.log" 2>&1
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
sparse, dense = (json.load(open(f"{out}/eval-{n}.json")) for n in ("sparse", "dense"))
ppl = lambda e: e["perplexity"]["perplexity"]
density = sum(l["density"] for l in sparse["layers"]) / len(sparse["layers"])
print(f"held-out perplexity: sparse {ppl(sparse):.2f}, dense {ppl(dense):.2f}, "
      f"ratio {ppl(sparse) / ppl(dense):.3f}; sparse mean FFN density {100 * density:.2f}%")
PY
