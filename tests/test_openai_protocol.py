"""OpenAI request -> SamplingParams mapping, unsupported-field policy, error shape."""
import pytest
from pydantic import ValidationError

from srt.entrypoints.openai_protocol import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, error_body, validation_error_message,
)
from srt.tokenizer_utils import apply_chat_template

MSGS = [{"role": "user", "content": "hi"}]


def test_chat_mapping_and_defaults():
    r = ChatCompletionRequest(messages=MSGS, max_tokens=5, max_completion_tokens=7, stop="x",
                              temperature=0.5, top_p=0.9, seed=3, top_k=4, min_p=0.1, min_tokens=2,
                              stop_token_ids=[9], ignore_eos=True, skip_special_tokens=False)
    assert r.sampling_params() == {
        "max_new_tokens": 7, "ignore_eos": True, "skip_special_tokens": False, "temperature": 0.5,
        "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 3, "stop": "x", "stop_token_ids": [9],
        "min_new_tokens": 2,
    }
    # No max_tokens: chat runs to the context (None), completions default to 16 (OpenAI).
    assert ChatCompletionRequest(messages=MSGS).sampling_params()["max_new_tokens"] is None
    assert CompletionRequest(prompt="a").sampling_params()["max_new_tokens"] == 16


@pytest.mark.parametrize("extra,msg", [
    ({"n": 2}, "n must be 1"), ({"bogus": 1}, "bogus"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": True}, "logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
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
    assert CompletionRequest(prompt=["a"]).single_prompt() == "a"
    assert CompletionRequest(prompt=[1, 2]).single_prompt() == [1, 2]
    with pytest.raises(ValueError, match="Batched"):
        CompletionRequest(prompt=[[1], [2]]).single_prompt()
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest(prompt="a", echo=True)


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
