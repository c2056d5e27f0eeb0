"""Loads checkpoints saved by candle-twell with transformers' LlamaForCausalLM and compares
their logits with the ones our model computed (expected_logits.json beside each checkpoint).

    cargo run --release --example export_tiny -- DIR      # here
    python3 scripts/check_transformers.py DIR/tiny-*      # where transformers is installed
Exits non-zero if any checkpoint fails to load or its logits differ (relative L2 > 1e-4).
"""
import json
import sys

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

failed = 0
for path in sys.argv[1:]:
    expected = json.load(open(f"{path}/expected_logits.json"))
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([expected["tokens"]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    ref = torch.tensor(expected["logits"])
    err = ((logits - ref).norm() / ref.norm()).item()
    encoded = tok(expected["text"], add_special_tokens=False)["input_ids"]
    ok = err < 1e-4 and encoded == expected["tokens"]
    failed += not ok
    print(f"{path}: hidden_act={model.config.hidden_act} logits rel err {err:.2e}, tokenizer {'ok' if encoded == expected['tokens'] else encoded} -> {'ok' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
