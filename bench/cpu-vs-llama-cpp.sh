#!/usr/bin/env bash
# CPU decode against llama.cpp on the same GGUF: llama.cpp (node-llama-cpp's prebuilt CPU
# build, installed here from npm), `twell generate --dense` (the same GGUF through
# quantized rows) and `twell generate` (the sparse default), alternated, THREADS threads
# each, greedy, MAX_TOKENS new tokens, ROUNDS rounds over three plain-text prompts.
# Prints each run and the medians; every run's JSON and peak RSS go under OUT.
#   bench/cpu-vs-llama-cpp.sh [TWELL FLAGS...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
twell=${TWELL:-target/release/twell}
rounds=${ROUNDS:-3}
max_tokens=${MAX_TOKENS:-128}
threads=${THREADS:-2}
out=${OUT:-$(mktemp -d)}
gguf=${TWELL_DATA:-data}/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$out"
(cd bench/llama-cpp && [ -d node_modules/node-llama-cpp ] || npm install --no-audit --no-fund --silent)
prompts=(
  "The history of the printing press begins"
  "The lighthouse keeper climbed the stairs and"
  "Vaccines train the immune system by"
)
export RAYON_NUM_THREADS=$threads
for round in $(seq 1 "$rounds"); do
  for p in "${!prompts[@]}"; do
    for engine in llama-cpp dense sparse; do
      run="$out/$engine-r$round-p$p"
      case $engine in
        llama-cpp)
          /usr/bin/time -f "%M" -o "$run.rss" node bench/llama-cpp/generate.mjs "$gguf" \
            "${prompts[$p]}" "$max_tokens" "$threads" > "$run.json" ;;
        dense | sparse)
          flags=()
          [ "$engine" = dense ] && flags=(--dense)
          /usr/bin/time -f "%M" -o "$run.rss" "$twell" generate "${flags[@]}" "$@" \
            --prompt "${prompts[$p]}" --max-tokens "$max_tokens" --json "$run.json" \
            > /dev/null 2> "$run.log" ;;
      esac
      python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], f\"prefill {s['prompt_tokens']/s['prefill_secs']:.0f} tok/s, decode {(s['generated_tokens']-1)/s['decode_secs']:.1f} tok/s, peak RSS {int(open(sys.argv[3]).read().split()[-1])//1024} MiB\")" \
        "$run.json" "$engine r$round p$p" "$run.rss"
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
summary = {}
for engine in ("llama-cpp", "dense", "sparse"):
    runs = sorted(glob.glob(f"{out}/{engine}-*.json"))
    stats = [json.load(open(f)) for f in runs]
    rss = [int(open(f[:-5] + ".rss").read().split()[-1]) / 1024 for f in runs]
    summary[engine] = {
        "runs": len(stats),
        "decode_tokens_per_sec": statistics.median((s["generated_tokens"] - 1) / s["decode_secs"] for s in stats),
        "prefill_tokens_per_sec": statistics.median(s["prompt_tokens"] / s["prefill_secs"] for s in stats),
        "peak_rss_mib": max(rss),
    }
anchor = summary["llama-cpp"]
for engine in ("dense", "sparse"):
    s = summary[engine]
    s["decode_vs_llama_cpp"] = s["decode_tokens_per_sec"] / anchor["decode_tokens_per_sec"]
    s["prefill_vs_llama_cpp"] = s["prefill_tokens_per_sec"] / anchor["prefill_tokens_per_sec"]
    s["rss_vs_llama_cpp"] = s["peak_rss_mib"] / anchor["peak_rss_mib"]
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
for engine, s in summary.items():
    extra = "" if engine == "llama-cpp" else f"  ({s['decode_vs_llama_cpp']:.2f}x decode, {s['prefill_vs_llama_cpp']:.2f}x prefill, {s['rss_vs_llama_cpp']:.2f}x RSS)"
    print(f"{engine:10s} decode {s['decode_tokens_per_sec']:6.1f} tok/s  prefill {s['prefill_tokens_per_sec']:6.0f} tok/s  peak RSS {s['peak_rss_mib']:5.0f} MiB{extra}")
print(f"runs and summary.json in {out}")
PY
