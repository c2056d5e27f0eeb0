// Greedy generation with llama.cpp (node-llama-cpp's prebuilt CPU build), timed as
// `twell generate` times itself: prefill = prompt tokens / time to the first new token,
// decode = the tokens after the first / the time they took.
//   node generate.mjs MODEL.gguf "PROMPT" MAX_TOKENS THREADS
import { getLlama } from "node-llama-cpp";

const [modelPath, prompt, maxTokensArg, threadsArg] = process.argv.slice(2);
if (!modelPath || prompt === undefined) {
  console.error("usage: node generate.mjs MODEL.gguf PROMPT [MAX_TOKENS] [THREADS]");
  process.exit(2);
}
const maxTokens = Number(maxTokensArg ?? 128);
const threads = Number(threadsArg ?? 2);
const llama = await getLlama({ gpu: false, build: "never" });
const model = await llama.loadModel({ modelPath });
const context = await model.createContext({ contextSize: 2048, threads });
const sequence = context.getSequence();
const tokens = model.tokenize(prompt);
const t0 = performance.now();
let first = null;
let generated = 0;
const out = [];
for await (const token of sequence.evaluate(tokens, { temperature: 0 })) {
  generated += 1;
  if (first === null) first = performance.now();
  if (model.isEogToken(token)) break;
  out.push(token);
  if (generated >= maxTokens) break;
}
const end = performance.now();
const stats = {
  engine: "llama.cpp",
  node_llama_cpp: "3.22.1",
  llama_cpp_release: llama.llamaCppRelease?.release ?? null,
  threads,
  prompt_tokens: tokens.length,
  generated_tokens: generated,
  prefill_secs: (first - t0) / 1000,
  decode_secs: (end - first) / 1000,
  prefill_tokens_per_sec: tokens.length / ((first - t0) / 1000),
  decode_tokens_per_sec: (generated - 1) / ((end - first) / 1000),
  text: model.detokenize(out),
};
console.log(JSON.stringify(stats));
await context.dispose();
await model.dispose();
