"""Dense PyTorch eager baseline of a whole Llama model, for `twell bench model` to be read against.

Run on the GPU machine:
  python3 bench/torch_model.py --shape 2048x5632x28 --json out.json
The same shapes as `twell bench model --device cuda --dtype bf16 --shape HxFxL --heads 32
--vocab 49152`: a random-init transformers LlamaForCausalLM with a ReLU gate (ReGLU), bf16,
SDPA attention. It times prefill (no cache), decode with a KV cache at a set context, and a
training step (forward + backward + AdamW on f32 master weights under bf16 autocast).
CUDA events, the median of repeated runs after warm-up. Peak memory comes from
torch.cuda.max_memory_allocated.
"""
import argparse
import json
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def pairs(text):
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p]


def timed(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x5632x28")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prefill", default="4x2048,16x2048")
    ap.add_argument("--decode-batch", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--train", default="1x2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hidden, ffn, layers = (int(v) for v in args.shape.split("x"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        hidden_act="relu",
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    rows = []

    with dev:  # initialise on the GPU: a CPU init of 2B parameters takes minutes
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for b, t in pairs(args.prefill):
            ids = torch.randint(0, args.vocab, (b, t), device=dev)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            s = timed(lambda: model(ids, use_cache=False, logits_to_keep=1), args.reps, args.warmup)
            rows.append(dict(phase="prefill", batch=b, seq=t, tokens_per_sec=b * t / s, ms=s * 1e3,
                             peak_extra_bytes=torch.cuda.max_memory_allocated() - base))
        for b in (int(v) for v in args.decode_batch.split(",") if v):
            ids = torch.randint(0, args.vocab, (b, args.context), device=dev)
            step_ids = torch.randint(0, args.vocab, (b, 1), device=dev)

            def decode():
                out = model(ids, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                for _ in range(args.decode_steps):
                    out = model(step_ids, past_key_values=past, use_cache=True)
                    past = out.past_key_values

            def prefill_only():
                model(ids, use_cache=True, logits_to_keep=1)

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with_decode = timed(decode, args.reps, args.warmup)
            without = timed(prefill_only, args.reps, args.warmup)
            per_step = max(with_decode - without, 1e-9) / args.decode_steps
            rows.append(dict(phase="decode", batch=b, seq=args.context, tokens_per_sec=b / per_step,
                             ms=per_step * 1e3,
                             peak_extra_bytes=torch.cuda.max_memory_allocated() - base))
    del model
    torch.cuda.empty_cache()

    for b, t in pairs(args.train):
        with dev:
            model = LlamaForCausalLM(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        ids = torch.randint(0, args.vocab, (b, t + 1), device=dev)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        s = timed(step, args.reps, args.warmup)
        rows.append(dict(phase="train", batch=b, seq=t, tokens_per_sec=b * t / s, ms=s * 1e3,
                         peak_extra_bytes=torch.cuda.max_memory_allocated() - base))
        del model, opt
        torch.cuda.empty_cache()

    report = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), shape=args.shape,
                  heads=args.heads, vocab=args.vocab, rows=rows)
    for r in rows:
        print(f"{r['phase']:>8} {r['batch']:>4} x {r['seq']:<5} {r['tokens_per_sec']:>12.1f} tok/s "
              f"{r['ms']:>9.3f} ms  peak extra {r['peak_extra_bytes'] / 2**20:9.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
