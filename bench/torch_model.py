"""Dense PyTorch eager baseline of a whole Llama model, for `twell bench model` to be read against.

Run on the GPU machine:
  python3 bench/torch_model.py --shape 2048x5632x28 --json out.json
The same shapes as `twell bench model --device cuda --dtype bf16 --shape HxFxL --heads 32
--vocab 49152`: a random-init transformers LlamaForCausalLM with a ReLU gate (ReGLU), bf16,
SDPA attention. It times prefill (no cache), decode with a KV cache at a set context, and a
training step (forward + backward + AdamW on f32 master weights under bf16 autocast).
With --graph-decode-batch it also times a gpt-fast-style decode (static KV cache, each
step one replayed CUDA graph; with --compile also through torch.compile first), the strong
anchor of `twell bench model`'s decode-graph rows:
  python3 bench/torch_model.py --shape 2048x5632x28 --prefill "" --decode-batch "" \
      --train "" --graph-decode-batch 1,16,64 --compile
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


def graph_decode(hidden, ffn, layers, args, batch, compiled):
    """A gpt-fast-style dense decode: a plain-torch Llama (ReGLU MLP, tied head) with a
    static KV cache, one step captured as a CUDA graph and replayed per token; with
    `compiled`, the step goes through torch.compile (inductor, no cudagraphs of its own)
    before the capture. The strong anchor for `twell bench model`'s `decode-graph`."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    heads, kv_heads = args.heads, args.kv_heads or args.heads
    hd = hidden // heads
    ctx = args.context + args.decode_steps + 1
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=dev, generator=g, dtype=torch.float32) * 0.02).to(dt)

    embed = w(args.vocab, hidden)
    blocks = [dict(qkv=w((heads + 2 * kv_heads) * hd, hidden), o=w(hidden, heads * hd),
                   gate=w(ffn, hidden), up=w(ffn, hidden), down=w(hidden, ffn),
                   n1=torch.ones(hidden, device=dev, dtype=dt), n2=torch.ones(hidden, device=dev, dtype=dt))
              for _ in range(layers)]
    norm = torch.ones(hidden, device=dev, dtype=dt)
    kc = [torch.zeros(batch, kv_heads, ctx, hd, device=dev, dtype=dt) for _ in range(layers)]
    vc = [torch.zeros(batch, kv_heads, ctx, hd, device=dev, dtype=dt) for _ in range(layers)]
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(ctx, device=dev, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)

    def rms(x, a):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * a

    def rope(x, pos):  # x [b, h, 1, hd]
        c, s_ = cos[pos].view(1, 1, 1, -1), sin[pos].view(1, 1, 1, -1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)

    def step(ids, pos):  # ids [b], pos [1] (one position for the batch, as gpt-fast)
        x = embed[ids]
        mask = (torch.arange(ctx, device=dev) <= pos).view(1, 1, 1, ctx)
        for l, bl in enumerate(blocks):
            h = rms(x, bl["n1"])
            qkv = h @ bl["qkv"].t()
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
            q = rope(q.view(batch, 1, heads, hd).transpose(1, 2), pos)
            k = rope(k.view(batch, 1, kv_heads, hd).transpose(1, 2), pos)
            v = v.view(batch, 1, kv_heads, hd).transpose(1, 2)
            kc[l].index_copy_(2, pos, k)
            vc[l].index_copy_(2, pos, v)
            kk, vv = kc[l], vc[l]
            if kv_heads != heads:
                kk = kk.repeat_interleave(heads // kv_heads, 1)
                vv = vv.repeat_interleave(heads // kv_heads, 1)
            y = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + y.transpose(1, 2).reshape(batch, heads * hd) @ bl["o"].t()
            h = rms(x, bl["n2"])
            x = x + (torch.relu(h @ bl["gate"].t()) * (h @ bl["up"].t())) @ bl["down"].t()
        return (rms(x, norm) @ embed.t()).float()

    fn = torch.compile(step, mode="max-autotune-no-cudagraphs", fullgraph=True) if compiled else step
    ids = torch.randint(0, args.vocab, (batch,), device=dev)
    pos = torch.tensor([args.context], device=dev)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(ids, pos)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(ids, pos)

        def decode():
            for s in range(args.decode_steps):
                pos.fill_(args.context + s)
                graph.replay()

        per_run = timed(decode, args.reps, args.warmup)
    per_step = per_run / args.decode_steps
    return dict(phase="decode-graph-compiled" if compiled else "decode-graph", batch=batch,
                seq=args.context, tokens_per_sec=batch / per_step, ms=per_step * 1e3,
                peak_extra_bytes=0)


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
    ap.add_argument("--graph-decode-batch", default="",
                    help="batch sizes of the static-cache decode replayed as a CUDA graph")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--compile", action="store_true",
                    help="also time the graph decode with torch.compile (inductor) before capture")
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

    for b in (int(v) for v in args.graph_decode_batch.split(",") if v):
        for compiled in ([False, True] if args.compile else [False]):
            rows.append(graph_decode(hidden, ffn, layers, args, b, compiled))

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
