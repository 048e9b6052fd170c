"""Tools and tool-call history into the chat template.

A template that mentions ``tools`` (Qwen2.5, Hermes, Llama 3.1, ...) gets them natively:
``tools=`` and the history's ``tool_calls`` (arguments parsed into objects, as vLLM
passes them: templates write them with ``tojson``) and ``role: "tool"`` messages as they
are. A template without tools (the embedded SmolLM2's) gets the default format as text:
the format's system-prompt section listing the tools, assistant calls written into the
assistant's content, and tool results as a user turn wrapped in the format's result
tags (consecutive results share one turn). docs/tools.md documents both.
"""
from __future__ import annotations

import hashlib
import json
import string

from constrained.json_input import load_json_text
from constrained.pythonic_args import render_calls as render_pythonic
from constrained.qwen_xml_args import render_parameters
from srt.function_call.formats import ToolCallFormat
from srt.function_call.tools import ToolCallError, ToolRequest

_ALNUM = string.ascii_letters + string.digits


def template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return "tools" in str(template or "")


def prepare_messages(messages: list[dict], req: ToolRequest, fmt: ToolCallFormat,
                     native: bool) -> tuple[list[dict], dict]:
    """(messages for the template, extra template kwargs) for one request."""
    msgs = [_with_parsed_calls(m, i) for i, m in enumerate(messages)]
    if native:
        if fmt.call_id_style == "mistral9":
            msgs = [_mistral_ids(m) for m in msgs]
        return msgs, ({"tools": list(req.shown)} if req.shown else {})
    out: list[dict] = []
    results_turn = None  # the user turn holding the latest run of tool results
    for m in msgs:
        if m["role"] == "tool":
            result = f"{fmt.result_begin}{m.get('content', '')}{fmt.result_end}"
            if results_turn is not None and out[-1] is results_turn:
                results_turn["content"] += "\n" + result
            else:
                results_turn = {"role": "user", "content": result}
                out.append(results_turn)
            continue
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if calls:
            text = render_calls(fmt, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + [text])
        out.append(m)
    if req.shown:
        section = fmt.render_tools(list(req.shown))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, {}


def _with_parsed_calls(m: dict, i: int) -> dict:
    """Check an assistant message's ``tool_calls``; their arguments (a JSON string, as
    OpenAI sends them) become objects."""
    calls = m.get("tool_calls")
    if calls is None:
        return m
    where = f"messages[{i}].tool_calls"
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise ToolCallError(f"{where} must be a list, on an assistant message", "messages")
    parsed = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolCallError(f'{where}[{j}] must be {{"type": "function", "function": '
                                f'{{"name": ..., "arguments": ...}}}}', "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):  # depth-checked: "[" * 5000 is a 400, not a RecursionError
            try:
                args = load_json_text(args or "{}", f"{where}[{j}].function.arguments")
            except ValueError as e:
                raise ToolCallError(str(e), "messages") from None
        if not isinstance(args, dict):
            raise ToolCallError(f"{where}[{j}].function.arguments must be a JSON object", "messages")
        parsed.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return {**m, "tool_calls": parsed}


def render_calls(fmt: ToolCallFormat, calls: list[tuple[str, dict]]) -> str:
    """One assistant turn's calls as the format writes them (the grammar's literals)."""
    if fmt.args_style == "pythonic":
        return render_pythonic(calls)
    def one(name: str, args: dict) -> str:
        if fmt.args_style == "qwen_xml":  # the last </parameter>'s newline is the call end's
            text = render_parameters(args, json_literals=True).removesuffix("\n")
        else:
            text = json.dumps(args, ensure_ascii=False)
        return f"{fmt.call_begin}{name}{fmt.args_begin}{text}{fmt.call_end}"
    return fmt.calls_begin + fmt.separator.join(one(n, a) for n, a in calls) + fmt.calls_end


def mistral_call_id(call_id: str) -> str:
    """Mistral's templates raise unless an id is 9 alphanumerics: other ids (OpenAI's
    ``call_...``) map to 9 derived from them, the same for a call and its result."""
    if len(call_id) == 9 and call_id.isalnum() and call_id.isascii():
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(digest // 62 ** i) % 62] for i in range(9))


def _mistral_ids(m: dict) -> dict:
    if m.get("tool_calls"):
        m = {**m, "tool_calls": [{**c, "id": mistral_call_id(str(c.get("id") or ""))} for c in m["tool_calls"]]}
    if m.get("role") == "tool" and m.get("tool_call_id") is not None:
        m = {**m, "tool_call_id": mistral_call_id(str(m["tool_call_id"]))}
    return m
