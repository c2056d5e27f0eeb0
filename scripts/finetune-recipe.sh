#!/usr/bin/env bash
# The sparsity fine-tune of docs/finetuning.md on the default model (SmolLM2-135M-Instruct):
# texts sampled from the starting model, the sparse run (gate-l0 term, λ steered to 2.9%
# density read on the validation split), its λ = 0 twin, then `twell eval` of both and the
# ratio of their held-out perplexities. Needs a CUDA build of `twell` and one GPU.
#   scripts/finetune-recipe.sh OUTDIR
# TWELL names the binary (default: twell on PATH); STEPS the steps of each run (default
# 3000, the recipe). A run stops after --time-limit seconds with a step-N checkpoint: run
# the same command again and each unfinished run resumes from its latest one.
set -euo pipefail

out=${1:?usage: finetune-recipe.sh OUTDIR}
twell=${TWELL:-twell}
steps=${STEPS:-3000}
mkdir -p "$out"

if [ ! -e "$out/samples/.complete" ]; then
  echo "== 8,192 texts sampled from the starting model" >&2
  "$twell" sample --device cuda --count 8192 --batch 256 --prompt-tokens 32 --max-tokens 480 \
    --temperature 0.8 --seed 0 --out "$out/samples"
  touch "$out/samples/.complete"
fi

common=(--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps "$steps"
  --lr 2e-3 --warmup 20 --weight-decay 0.1 --distill 0.5 --extra-data "$out/samples/*.txt"
  --seed 0 --eval-every 100 --eval-batches 8 --save-every 500 --time-limit 470)
sparse=(--l1 2e-3 --l1-warmup 50 --penalty gate-l0 --l1-target-density 0.029
  --l1-target-anneal 1600 --l1-target-text validation)

# run NAME FLAGS...: the fine-tune into OUTDIR/NAME, resumed from its latest step-N.
run() {
  local name=$1; shift
  [ -d "$out/$name/final" ] && { echo "$name: finished" >&2; return; }
  local last resume=()
  last=$(ls -d "$out/$name"/step-* 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$last" ] && resume=(--resume "$last")
  echo "== $name ${resume[*]}" >&2
  "$twell" finetune "${common[@]}" "$@" ${resume[@]+"${resume[@]}"} --out "$out/$name"
}
run gate-l0-2.9pct "${sparse[@]}"
run twin --l1 0

for name in gate-l0-2.9pct twin; do
  [ -d "$out/$name/final" ] || { echo "$name is not finished: run the same command again" >&2; exit 0; }
done
for name in gate-l0-2.9pct twin; do
  "$twell" eval --device cuda --model "$out/$name/final" --last 10 --json "$out/eval-$name.json" \
    >"$out/eval-$name.log" 2>&1
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
sparse, twin = (json.load(open(f"{out}/eval-{n}.json")) for n in ("gate-l0-2.9pct", "twin"))
ppl = lambda e: e["perplexity"]["perplexity"]
density = sum(l["density"] for l in sparse["layers"]) / len(sparse["layers"])
print(f"held-out perplexity: sparse {ppl(sparse):.2f}, twin {ppl(twin):.2f}, "
      f"ratio {ppl(sparse) / ppl(twin):.3f}; sparse density {100 * density:.2f}%")
PY
