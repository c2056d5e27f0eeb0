#!/usr/bin/env bash
# Decode speed of the sparse default model against the dense default on this machine:
# `twell generate` alternating the two (`--dense` first), ROUNDS rounds over several
# prompts, greedy, MAX_TOKENS new tokens each; prints each run and the medians, and
# writes every run's JSON statistics under OUT (default: a temporary directory).
#   bench/cpu-decode.sh [TWELL FLAGS...]      e.g. --device cuda
# TWELL names the binary (default: target/release/twell).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
twell=${TWELL:-target/release/twell}
rounds=${ROUNDS:-3}
max_tokens=${MAX_TOKENS:-128}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
prompts=(
  "Tell me about the history of the printing press."
  "Write a short story about a lighthouse keeper."
  "Explain how vaccines train the immune system."
)
for round in $(seq 1 "$rounds"); do
  for p in "${!prompts[@]}"; do
    for model in dense sparse; do
      flags=()
      [ "$model" = dense ] && flags=(--dense)
      "$twell" generate "${flags[@]}" "$@" --chat --prompt "${prompts[$p]}" \
        --max-tokens "$max_tokens" \
        --json "$out/$model-r$round-p$p.json" >/dev/null 2>"$out/$model-r$round-p$p.log"
      tail -1 "$out/$model-r$round-p$p.log"
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def runs(model):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{model}-*.json"))]
rate = lambda s, k: s[f"{k}_tokens"] / s[f"{k}_secs"] if s[f"{k}_secs"] > 0 else float("nan")
summary = {}
for model in ("dense", "sparse"):
    r = runs(model)
    summary[model] = {
        "runs": len(r),
        "decode_tokens_per_sec": statistics.median(s["generated_tokens"] / s["decode_secs"] for s in r),
        "prefill_tokens_per_sec": statistics.median(s["prompt_tokens"] / s["prefill_secs"] for s in r),
        "mean_ffn_density": statistics.mean(s["mean_ffn_density"] for s in r if s["mean_ffn_density"] is not None) if model == "sparse" else None,
    }
d, s = summary["dense"], summary["sparse"]
summary["decode_speedup"] = s["decode_tokens_per_sec"] / d["decode_tokens_per_sec"]
summary["prefill_speedup"] = s["prefill_tokens_per_sec"] / d["prefill_tokens_per_sec"]
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(f"decode  tokens/s (median): dense {d['decode_tokens_per_sec']:.1f}, sparse {s['decode_tokens_per_sec']:.1f}, {summary['decode_speedup']:.2f}x")
print(f"prefill tokens/s (median): dense {d['prefill_tokens_per_sec']:.1f}, sparse {s['prefill_tokens_per_sec']:.1f}, {summary['prefill_speedup']:.2f}x")
print(f"sparse mean FFN density {100 * s['mean_ffn_density']:.2f}%; runs and summary.json in {out}")
PY
