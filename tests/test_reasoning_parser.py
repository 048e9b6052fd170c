"""The reasoning split (srt/frontend/reasoning_parser.py) and thinking_budget's request
checks: the thinking and the answer apart, markers in neither, the same split whole and in
any streamed chunking, and the one per-request decision whether the output starts thinking."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from sampling.sampling_params import SamplingParams
from srt.entrypoints.openai_protocol import ChatCompletionRequest
from srt.frontend.generate_input import prepare_request
from srt.frontend.reasoning_parser import FORMATS, ReasoningSplit, request_reasons
from test_openai_protocol import INFO, MSGS

TEXTS = [
    ("Let me see.\n</think>\n\n{\"a\": 1}", "Let me see.\n", "{\"a\": 1}"),
    ("<think>\nhmm</think>{}", "\nhmm", "{}"),  # qwen3 writes the think start itself
    ("still thinking, cut by max_tokens </thi", "still thinking, cut by max_tokens </thi", ""),
    ("</think>  \n", None, ""),  # no thinking at all, and an empty answer
    ("a </think> b </think> c", "a ", "b </think> c"),  # only the first ends the thinking
]


def _stream(split: ReasoningSplit, text: str, cuts: list[int]) -> tuple[str, str]:
    p, r, c = split.parser(), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        dr, dc = p.feed(text[a:b])
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    return r + dr, c + dc


@pytest.mark.parametrize("text,reasoning,answer", TEXTS)
def test_split_whole_and_streamed_alike(text, reasoning, answer):
    split = ReasoningSplit.of("qwen3.5", True, True)
    assert split.split(text) == (reasoning, answer)
    for size in (1, 2, 3, 7):  # every chunking, markers cut anywhere
        assert _stream(split, text, list(range(size, len(text), size))) == (reasoning or "", answer)


@pytest.mark.parametrize("text", [t for t, _, _ in TEXTS])
def test_separate_reasoning_false_keeps_the_text_verbatim_in_content(text):
    split = ReasoningSplit.of("qwen3", True, False)
    reasoning, answer = split.split(text)
    assert split.message(reasoning, {"content": answer})["content"] == text
    assert "reasoning_content" not in split.message(reasoning, {"content": answer})
    r, c = _stream(split, text, list(range(1, len(text))))
    assert r + c == text and split.delta("x") == [{"content": "x"}]


def test_a_request_that_does_not_reason_is_all_answer():
    for split in (ReasoningSplit.of("qwen3.5", False, True), ReasoningSplit.of(None, True, True)):
        assert split.split("<think>a</think>b") == (None, "<think>a</think>b")
        assert _stream(split, "x </th", [3]) == ("", "x </th")  # nothing held back


def test_one_decision_per_request_for_every_parser():
    assert set(FORMATS) == {"qwen3", "deepseek-r1", "qwen3.5", "qwen3-thinking"}
    for name in FORMATS:
        assert request_reasons(name, None) and request_reasons(name, {"enable_thinking": True})
        assert request_reasons(name, {"enable_thinking": False}) == (name == "deepseek-r1")
        body = ChatCompletionRequest(messages=MSGS, chat_template_kwargs={"enable_thinking": False})
        assert body.requires_reasoning(name) == request_reasons(name, {"enable_thinking": False})
    assert not request_reasons(None, None)


@pytest.mark.parametrize("bad", [-1, "5", 2.5, True])
def test_thinking_budget_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValidationError, match="thinking_budget"):
        ChatCompletionRequest(messages=MSGS, thinking_budget=bad)
    with pytest.raises(ValueError, match="thinking_budget must be a non-negative integer"):
        SamplingParams.from_dict({"thinking_budget": bad})


def test_thinking_budget_reaches_the_scheduler_or_is_a_400_without_a_parser():
    obj = ChatCompletionRequest(messages=MSGS, thinking_budget=0).generate_input("rid", input_ids=[5, 6])
    req = prepare_request(obj, None, INFO, reasoning_parser="qwen3")
    assert req.sampling_params.thinking_budget == 0 and req.sampling_params.grammar_key == ("free", "")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        prepare_request(obj, None, INFO)
    with pytest.raises(ValueError, match="grammar-backend none"):
        prepare_request(obj, None, INFO, reasoning_parser="qwen3", grammar_backend="none")
    with_schema = SamplingParams.from_dict({"thinking_budget": 4, "regex": "a"})
    assert with_schema.grammar_key == ("regex", "a")
