"""Sampling parameters end to end: the REAL server (session ``server`` fixture in
conftest.py, started with --enable-custom-logit-processor) driven with the official `openai`
client; the native /generate endpoint where a test needs output token ids. Greedy
(temperature 0) and a few tokens per request (~30 tok/s on CPU)."""
import threading

import httpx
import openai
import pytest

from sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

pytestmark = pytest.mark.timeout(180)

REPEAT = "Repeat after me: the the the the"  # greedy repeats " the" forever
FRANCE = "The capital of France is"  # greedy starts with " Paris"
DISALLOW = DisallowedTokensLogitsProcessor.to_str()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)


def _complete(client, prompt, max_tokens=8, temperature=0, **kw) -> str:
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                  temperature=temperature, **kw)
    return r.choices[0].text


def _output_ids(server, prompt, **sampling) -> list[int]:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4, **sampling}}
    r = httpx.post(server + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _repeats(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    return len(ids) - len(set(ids))


def test_logit_bias_minus_100_bans_the_greedy_token(server, client, smollm2_tokenizer):
    first = _output_ids(server, FRANCE)[0]
    word = smollm2_tokenizer.decode([first])
    assert word == " Paris"
    assert _output_ids(server, FRANCE, logit_bias={str(first): -100})[0] != first
    text = _complete(client, FRANCE, max_tokens=4, logit_bias={str(first): -100})
    assert text and not text.startswith(word)


def test_logit_bias_plus_100_forces_a_token(server, client, smollm2_tokenizer):
    (tok,) = smollm2_tokenizer.encode(" ocean", add_special_tokens=False)
    assert _output_ids(server, FRANCE, logit_bias={str(tok): 100}) == [tok] * 4
    assert _complete(client, FRANCE, max_tokens=3, logit_bias={str(tok): 100}) == " ocean ocean ocean"


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2}, {"presence_penalty": 2},
                                     {"extra_body": {"repetition_penalty": 1.5}}])
def test_penalties_break_greedy_repetition(client, smollm2_tokenizer, penalty):
    plain = _complete(client, REPEAT, max_tokens=12)
    assert plain == " the" * 12
    penalized = _complete(client, REPEAT, max_tokens=12, **penalty)
    assert penalized != plain
    assert _repeats(smollm2_tokenizer, penalized) < _repeats(smollm2_tokenizer, plain)


def test_seed_makes_sampling_reproducible(client):
    kw = dict(max_tokens=8, temperature=1.0)
    first = _complete(client, "Once upon a time", seed=7, **kw)
    assert _complete(client, "Once upon a time", seed=7, **kw) == first
    others = [_complete(client, "Once upon a time", seed=s, **kw) for s in (8, 9, 10)]
    assert any(o != first for o in others)


def test_stop_strings(client):
    r = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=12, temperature=0,
                                  stop=[" 6", " 9"])
    ch = r.choices[0]
    assert (ch.text, ch.finish_reason, ch.model_extra["matched_stop"]) == (" 4, 5,", "stop", " 6")


def test_min_tokens_delays_eos(client):
    msgs = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    short = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    longer = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16, temperature=0,
                                            extra_body={"min_tokens": 12})
    assert longer.usage.completion_tokens >= 12
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)


def test_custom_logit_processor_disallows_the_greedy_token(server, client):
    first = _output_ids(server, FRANCE)[0]
    extra = {"custom_logit_processor": DISALLOW, "custom_params": {"token_ids": [first]}}
    text = _complete(client, FRANCE, max_tokens=4, extra_body=extra)
    assert text and not text.startswith(" Paris")
    body = {"text": FRANCE, "custom_logit_processor": DISALLOW,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "custom_params": {"token_ids": [first]}}}
    ids = httpx.post(server + "/generate", json=body, timeout=120).json()["output_ids"]
    assert first not in ids


def test_per_request_parameters_stay_per_request_in_one_batch(server, smollm2_tokenizer):
    """Penalized, banned and plain requests decoding together each get only their own
    parameters (native /generate, for the output ids)."""
    (the,) = smollm2_tokenizer.encode(" the", add_special_tokens=False)
    jobs = {
        "plain": {},
        "penalized": {"frequency_penalty": 2},
        "biased": {"logit_bias": {str(the): -100}},
        "disallowed": {"custom_params": {"token_ids": [the]}},
        "plain2": {},
    }
    out = {}

    def run(name, sampling):
        body = {"text": REPEAT, "sampling_params": {"temperature": 0, "max_new_tokens": 12, **sampling}}
        if "custom_params" in sampling:
            body["custom_logit_processor"] = DISALLOW
        out[name] = httpx.post(server + "/generate", json=body, timeout=150).json()["output_ids"]

    threads = [threading.Thread(target=run, args=job) for job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert out["plain"] == out["plain2"] == [the] * 12
    assert len(out["penalized"]) - len(set(out["penalized"])) < 11
    assert the not in out["biased"] and the not in out["disallowed"]


def _vocab(server) -> int:
    return httpx.get(server + "/get_server_info", timeout=10).json()["vocab_size"]


@pytest.mark.parametrize("kw,msg", [
    ({"frequency_penalty": 3}, r"frequency_penalty must be in \[-2, 2\], got 3"),
    ({"presence_penalty": -2.5}, r"presence_penalty must be in \[-2, 2\], got -2.5"),
    ({"extra_body": {"repetition_penalty": 2.5}}, r"repetition_penalty must be in \(0, 2\]"),
    ({"logit_bias": {"VOCAB": 1}}, r"logit_bias token ids must be in \[0, VOCAB\), got VOCAB"),
    ({"logit_bias": {"5": 101}}, r"logit_bias values must be in \[-100, 100\]"),
    ({"logit_bias": {"five": 1}}, "logit_bias keys must be token ids"),
    ({"extra_body": {"regex": "a+", "ebnf": "root ::= 'a'"}},
     "Only one constraint kind per request is allowed, got regex and ebnf"),
    ({"extra_body": {"regex": "a(b"}}, r"Failed to compile regex grammar: Regex parsing error"),
    ({"extra_body": {"choice": []}}, r"choice must be a non-empty list of strings"),
    ({"extra_body": {"custom_logit_processor": '{"callable": "no_such_module_gramsync:P"}'}},
     "cannot import module 'no_such_module_gramsync'"),
    ({"extra_body": {"custom_logit_processor": DISALLOW, "custom_params": {"token_ids": ["x"]}}},
     "token_ids"),
    ({"extra_body": {"custom_logit_processor": DISALLOW, "custom_params": {"token_ids": ["VOCAB"]}}},
     r"custom_params token_ids must be in \[0, VOCAB\), got VOCAB"),
])
def test_bad_sampling_parameters_are_400_with_the_message(server, client, kw, msg):
    vocab = _vocab(server)
    kw = _fill_vocab(kw, vocab)
    with pytest.raises(openai.BadRequestError, match=msg.replace("VOCAB", str(vocab))):
        _complete(client, "hi", max_tokens=2, **kw)
    assert _complete(client, "hi", max_tokens=2)  # the server still serves


def _fill_vocab(obj, vocab: int):
    """Replace the placeholder "VOCAB" (a key or a value) with the model's vocab size."""
    if isinstance(obj, dict):
        return {(str(vocab) if k == "VOCAB" else k): _fill_vocab(v, vocab) for k, v in obj.items()}
    if isinstance(obj, list):
        return [vocab if v == "VOCAB" else _fill_vocab(v, vocab) for v in obj]
    return obj
