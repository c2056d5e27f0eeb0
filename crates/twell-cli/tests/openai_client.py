"""Drives `twell serve` with the OpenAI Python client (openai==1.99.9, installed by
scripts/setup.sh into data/python): chat and text completions, whole and streamed, the
model list, and the errors the client raises for bad requests. Exits non-zero on any
failed check; prints how many requests it made (the test compares them with /metrics).

    python3 openai_client.py BASE_URL MODEL_ID
"""

import sys

import openai

base_url, model_id = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
requests = 0


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


question = [{"role": "user", "content": "What is the capital of France?"}]

# Chat, whole.
r = client.chat.completions.create(model="default", messages=question, max_tokens=24, temperature=0)
requests += 1
answer = r.choices[0].message.content
check("Paris" in answer, f"chat answer names Paris: {answer!r}")
check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, f"usage {r.usage}")
check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "usage adds up")
check(r.model == model_id, f"model {r.model}")

# Chat, streamed: the same greedy text, piece by piece, and the usage at the end.
pieces, finish, usage = [], None, None
for chunk in client.chat.completions.create(
    model=model_id, messages=question, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
requests += 1
check("".join(pieces) == answer, f"streamed {''.join(pieces)!r} equals whole {answer!r}")
check(len(pieces) > 1, "streamed in several pieces")
check(finish == r.choices[0].finish_reason, f"stream finish {finish}")
check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage}")

# A multi-turn conversation with a system message.
r = client.chat.completions.create(
    model="default",
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you?"},
        {"role": "user", "content": "Name a color."},
    ],
    max_tokens=16, temperature=0.7, top_p=0.9, seed=7,
)
requests += 1
check(len(r.choices[0].message.content) > 0, "multi-turn answer")

# Text completion, whole and streamed, with a stop text.
r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=12, temperature=0)
requests += 1
text = r.choices[0].text
check(len(text) > 0 and r.choices[0].finish_reason in ("stop", "length"), f"completion {text!r}")
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    if c.choices
)
requests += 1
check(streamed == text, f"streamed completion {streamed!r} equals {text!r}")
stop = text.strip().split()[0] if text.strip() else None
if stop:
    r = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=12, temperature=0, stop=[stop]
    )
    requests += 1
    check(stop not in r.choices[0].text and r.choices[0].finish_reason == "stop", f"stop {stop!r}: {r.choices[0].text!r}")

# The model list.
ids = [m.id for m in client.models.list().data]
requests += 1
check(model_id in ids and "default" in ids, f"models {ids}")

# Errors, as the client raises them.
try:
    client.chat.completions.create(model="no-such-model", messages=question, max_tokens=4)
    check(False, "unknown model refused")
except openai.NotFoundError as e:
    check(e.status_code == 404, "404 for an unknown model")
requests += 1
try:
    client.chat.completions.create(model="default", messages=[], max_tokens=4)
    check(False, "empty messages refused")
except openai.BadRequestError as e:
    check("messages" in str(e), f"empty messages: {e}")
requests += 1
try:
    client.chat.completions.create(model="default", messages=question, max_tokens=10**6)
    check(False, "max_tokens past the context refused")
except openai.BadRequestError as e:
    check("context" in str(e), f"max_tokens: {e}")
requests += 1

print(requests)
