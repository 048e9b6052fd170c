"""OpenAI request -> SamplingParams mapping, unsupported-field policy, error shape."""
import pytest
from pydantic import ValidationError

from sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from sampling.sampling_params import SamplingParams
from srt.entrypoints.openai_protocol import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, error_body, validation_error_message,
)
from srt.frontend.generate_input import prepare_request
from srt.transport.io_struct import SchedulerInfo
from srt.tokenizer_utils import apply_chat_template

MSGS = [{"role": "user", "content": "hi"}]
INFO = SchedulerInfo(max_total_num_tokens=4096, max_running_requests=8, context_len=8192,
                     vocab_size=1000, eos_token_ids=(2,))
DISALLOW = DisallowedTokensLogitsProcessor.to_str()


def _prepare(body: dict, enable_clp: bool = True, grammar_backend: str = "xgrammar"):
    """An OpenAI completion body through the same path the server takes (minus HTTP)."""
    req = CompletionRequest.model_validate({"prompt": [5, 6, 7], **body})
    return prepare_request(req.generate_input("rid", input_ids=req.prompts()[0]), None, INFO,
                           enable_custom_logit_processor=enable_clp, grammar_backend=grammar_backend)


def test_chat_mapping_and_defaults():
    r = ChatCompletionRequest(messages=MSGS, max_tokens=5, max_completion_tokens=7, stop="x",
                              temperature=0.5, top_p=0.9, seed=3, top_k=4, min_p=0.1, min_tokens=2,
                              stop_token_ids=[9], ignore_eos=True, skip_special_tokens=False)
    assert r.sampling_params() == {
        "max_new_tokens": 7, "ignore_eos": True, "skip_special_tokens": False, "temperature": 0.5,
        "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 3, "stop": "x", "stop_token_ids": [9],
        "min_new_tokens": 2, "n": 1,
    }
    # Unset fields are left out, so SamplingParams' defaults apply.
    assert ChatCompletionRequest(messages=MSGS).sampling_params() == {
        "max_new_tokens": None, "ignore_eos": False, "skip_special_tokens": True, "n": 1}
    # No max_tokens: chat runs to the context (None), completions default to 16 (OpenAI).
    assert ChatCompletionRequest(messages=MSGS).sampling_params()["max_new_tokens"] is None
    assert CompletionRequest(prompt="a").sampling_params()["max_new_tokens"] == 16


@pytest.mark.parametrize("extra,msg", [
    ({"bogus": 1}, "bogus"), ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ({"messages": []}, "messages"), ({"max_tokens": -1}, "max_tokens"),
])
def test_chat_rejects_with_a_message_naming_the_field(extra, msg):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": MSGS, **extra})
    assert msg in validation_error_message(e.value)[0]


def test_neutral_and_ignored_fields_are_accepted():
    ChatCompletionRequest.model_validate({
        "messages": MSGS, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
        "user": "u", "metadata": {"a": "b"}, "store": False, "tool_choice": "none",
        "response_format": {"type": "text"}, "stream_options": {"include_usage": True},
    })


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a"]).prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    with pytest.raises(ValidationError, match="empty list"):
        CompletionRequest(prompt=[])


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 0}, "max_tokens: 0 is only allowed with echo: true"),
    ({"echo": True, "logprobs": 21}, "less than or equal to 20"),
    ({"echo": True, "logprobs": -1}, "greater than or equal to 0"),
    ({"prompt": ["a"] * 1025}, "batch of 1025 prompts; at most 1024"),
])
def test_completion_echo_rules(body, message):
    with pytest.raises(ValidationError, match=message):
        CompletionRequest.model_validate({"prompt": "a", **body})
    # echo with n > 1 is served (each choice starts with the prompt)
    assert CompletionRequest.model_validate({"prompt": "a", "echo": True, "n": 2}).n == 2


def test_echo_asks_for_the_prompt_logprobs():
    r = CompletionRequest(prompt="a", echo=True, logprobs=2, max_tokens=0)
    assert r.logprob_fields() == {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    assert r.sampling_params()["max_new_tokens"] == 0
    assert CompletionRequest(prompt="a", logprobs=2).logprob_fields()["logprob_start_len"] == -1
    assert CompletionRequest(prompt="a", echo=True).logprob_fields() == {}


def test_chat_refuses_zero_max_tokens():
    with pytest.raises(ValidationError, match="must be at least 1"):
        ChatCompletionRequest(messages=MSGS, max_tokens=0)
    with pytest.raises(ValidationError, match="must be at least 1"):
        ChatCompletionRequest(messages=MSGS, max_completion_tokens=0)


def test_content_parts_flatten_and_images_are_rejected():
    m = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert m.for_template() == {"role": "user", "content": "a\nb"}
    with pytest.raises(ValueError, match="image_url"):
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]).for_template()


def test_error_shape():
    assert error_body("bad", 400, "top_p") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "top_p", "code": 400}}
    assert error_body("x", 500)["error"]["type"] == "InternalServerError"
    assert error_body("x", 503)["error"]["type"] == "ServiceUnavailableError"


def test_apply_chat_template(smollm2_tokenizer):
    ids = apply_chat_template(smollm2_tokenizer, MSGS)
    assert ids and all(isinstance(t, int) for t in ids)
    assert smollm2_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_apply_chat_template_without_template_is_a_clear_error():
    class NoTemplate:
        chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(NoTemplate(), MSGS)


def test_penalties_logit_bias_and_extras_are_mapped():
    body = {"frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.3,
            "logit_bias": {"17": -100, "3": 2.5}, "seed": 9, "max_tokens": 4, "min_tokens": 1,
            "stop": ["\n"], "top_k": 5, "custom_params": {"token_ids": [4]},
            "custom_logit_processor": DISALLOW}
    req = _prepare(body)
    p = req.sampling_params
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert p.logit_bias == ((3, 2.5), (17, -100.0))  # string keys -> sorted int pairs
    assert (p.seed, p.max_new_tokens, p.min_new_tokens, p.stop, p.top_k) == (9, 4, 1, ("\n",), 5)
    assert p.custom_logit_processor == DISALLOW and p.custom_params == {"token_ids": [4]}
    assert req.input_ids == (5, 6, 7)
    chat = ChatCompletionRequest(messages=MSGS, frequency_penalty=1, logit_bias={"1": 1},
                                 regex="a+", custom_params={"k": 1})
    sp = chat.sampling_params()
    assert (sp["frequency_penalty"], sp["logit_bias"], sp["regex"], sp["custom_params"]) == (
        1, {"1": 1}, "a+", {"k": 1})
    assert "json_schema" not in sp and "presence_penalty" not in sp


@pytest.mark.parametrize("body,msg", [
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3"),
    ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2], got 0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids, got 'abc'"),
    ({"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100], got 101.0 for token 5"),
    ({"logit_bias": {"1000": 1}}, "logit_bias token ids must be in [0, 1000), got 1000"),
    ({"regex": "a+", "ebnf": "root ::= 'a'"}, "Only one constraint kind per request is allowed, got regex and ebnf"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
    ({"regex": "a", "choice": ["a"]}, "Only one constraint kind per request is allowed, got regex and choice"),
    ({"json_schema": {"type": "object"}, "response_format": {"type": "json_object"}},
     "response_format and json_schema both give a constraint"),
    ({"custom_params": {"token_ids": [1]}}, "custom_params needs a custom_logit_processor"),
    ({"custom_logit_processor": "nope"}, "custom_logit_processor is not valid JSON"),
    ({"custom_logit_processor": DISALLOW, "custom_params": {"token_ids": [1000]}},
     "custom_params token_ids must be in [0, 1000), got 1000"),
])
def test_range_and_constraint_errors_are_value_errors_with_the_message(body, msg):
    with pytest.raises(ValueError) as e:  # the handlers turn these into HTTP 400
        _prepare(body)
    assert msg in str(e.value)


def test_constraints_map_to_sampling_params():
    assert _prepare({"regex": "[0-9]+"}).sampling_params.constraint == ("regex", "[0-9]+")
    assert _prepare({"choice": ["a", "b"]}).sampling_params.constraint == ("choice", '["a", "b"]')
    # Equal schemas written differently share one cache key; key order is kept.
    a = _prepare({"json_schema": '{ "type" : "object", "properties": {"b": {}, "a": {}} }'})
    b = _prepare({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}})
    assert a.sampling_params.constraint == b.sampling_params.constraint == (
        "json_schema", '{"type":"object","properties":{"b":{},"a":{}}}')
    # strict is a guarantee (schema_coverage.py): it travels in the spec, so in the cache key.
    strict = _prepare({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}})
    native = SamplingParams.from_dict({"json_schema": {"type": "object", "properties": {"b": {}, "a": {}}},
                                       "json_schema_strict": True})
    assert strict.sampling_params.constraint == native.constraint == (
        "json_schema", '{"type":"object","properties":{"b":{},"a":{}},"x-gramsync-strict":true}')
    assert _prepare({"response_format": {"type": "json_object"}}).sampling_params.json_schema == '{"type":"object"}'
    assert _prepare({"response_format": {"type": "text"}}).sampling_params.constraint is None


def test_constraints_are_rejected_when_the_backend_is_none():
    with pytest.raises(ValueError, match=r"disabled on this server \(--grammar-backend none\)"):
        _prepare({"regex": "a"}, grammar_backend="none")
    assert _prepare({}, grammar_backend="none").sampling_params.constraint is None


def test_custom_logit_processor_needs_the_server_flag():
    body = {"custom_logit_processor": DISALLOW, "custom_params": {"token_ids": [1]}}
    with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
        _prepare(body, enable_clp=False)
    assert _prepare(body).sampling_params.custom_logit_processor == DISALLOW


def test_logit_bias_value_type_is_checked_by_pydantic():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "a", "logit_bias": {"5": "lots"}})
    assert "logit_bias.5" in validation_error_message(e.value)[0]
    assert SamplingParams.from_dict(CompletionRequest(prompt="a", logit_bias={"5": -1}).sampling_params()
                                    ).logit_bias == ((5, -1.0),)


def test_requires_reasoning_follows_the_parser_and_enable_thinking():
    r = ChatCompletionRequest(messages=MSGS)
    assert not r.requires_reasoning(None) and r.requires_reasoning("qwen3") and r.requires_reasoning("deepseek-r1")
    off = ChatCompletionRequest(messages=MSGS, chat_template_kwargs={"enable_thinking": False})
    assert not off.requires_reasoning("qwen3") and off.requires_reasoning("deepseek-r1")
    obj = r.generate_input("rid", input_ids=[5, 6])
    obj.require_reasoning = True
    assert prepare_request(obj, None, INFO).require_reasoning
