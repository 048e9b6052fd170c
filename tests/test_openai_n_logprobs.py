"""``n`` and logprobs through the official ``openai`` client (and raw HTTP for the 400s),
on chat and completions, streamed and not, against the shared session server."""
from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Name a fruit."}]


def test_chat_n_choices_and_usage(client):
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, n=3, seed=11,
                                       temperature=1.0, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    # (Seeded reproducibility sample for sample is checked in fp32: tests/test_n_samples.py;
    # this server runs the machine's default dtype, where batch shape moves the logits.)
    single = client.chat.completions.create(model="smollm2", messages=MESSAGES, seed=11, temperature=1.0,
                                            max_tokens=8)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert 3 <= r.usage.completion_tokens <= 24  # every sample's tokens


def test_chat_logprobs_shape_and_values(client):
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, logprobs=True, top_logprobs=3,
                                       temperature=0, max_tokens=6)
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert content and "".join(t.token for t in content) == text
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen one is the most likely
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token or "\ufffd" in t.token


def test_chat_stream_n_and_logprobs_reassemble(client):
    kwargs = dict(model="smollm2", messages=MESSAGES, n=2, temperature=0, max_tokens=8,
                  logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**kwargs)
    texts, lps, finish = ["", ""], [[], []], [None, None]
    usage = None
    for ev in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if ev.usage is not None:
            usage = ev.usage
        for c in ev.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                lps[c.index] += [t.logprob for t in c.logprobs.content]
            finish[c.index] = c.finish_reason or finish[c.index]
    for i in range(2):
        assert texts[i] == whole.choices[i].message.content
        # The streamed request finds the prompt in the radix cache: in bf16 its first
        # position's logits come from a different computation (cached KV) and may differ a bit.
        assert lps[i] == pytest.approx([t.logprob for t in whole.choices[i].logprobs.content], abs=0.1)
        assert finish[i] == whole.choices[i].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completions_logprobs_and_n(client):
    r = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0,
                                  logprobs=2, n=2)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text  # greedy: identical
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)
    streamed, offsets = "", []
    for ev in client.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0,
                                        logprobs=2, stream=True):
        for c in ev.choices:
            streamed += c.text
            if c.logprobs is not None:
                offsets += c.logprobs.text_offset
    assert streamed == r.choices[0].text and offsets == lp.text_offset


@pytest.mark.parametrize("body, field", [
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": MESSAGES, "n": 129}, "n"),
])
def test_bad_values_name_the_field(server, body, field):
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


def test_completions_logprobs_range(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "logprobs": 21}, timeout=30)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_native_generate_n_and_logprobs(server):
    r = httpx.post(f"{server}/generate", timeout=60, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2},
        "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    assert r.status_code == 200
    outs = r.json()
    assert isinstance(outs, list) and [o["index"] for o in outs] == [0, 1]
    entries = outs[0]["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == outs[0]["output_ids"] and all(isinstance(e[2], str) for e in entries)
