"""The system-prompt section that teaches a format to a chat template without tools of its
own (the embedded SmolLM2's): one per format, ``{tools}`` being one JSON tool per line.
Hermes' is Qwen2.5's word for word (models trained on it call tools best with exactly
this); the others follow their family's own instructions, shortened."""
from __future__ import annotations

_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

"""

HERMES_SYSTEM_PROMPT = _TOOLS + """For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

QWEN3_CODER_PROMPT = _TOOLS + """If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call>"""

LLAMA3_PROMPT = _TOOLS + """To call a function, respond with a JSON object of the form
{{"name": function name, "parameters": dictionary of argument name and its value}}.
Separate several calls with "; ". Do not use variables."""

PYTHONIC_PROMPT = _TOOLS + """To call functions, respond with a Python list of calls and nothing else:
[func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)]"""

MISTRAL_PROMPT = _TOOLS + """To call functions, write [TOOL_CALLS] and a JSON list of calls:
[TOOL_CALLS][{{"name": function name, "arguments": arguments object}}]"""

MISTRAL_V11_PROMPT = _TOOLS + """To call a function, write [TOOL_CALLS], its name, [ARGS] and its arguments as a JSON object:
[TOOL_CALLS]function_name[ARGS]{{"arg": "value"}}"""

DEEPSEEK_PROMPT = _TOOLS + """To call functions, write them between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call."""
