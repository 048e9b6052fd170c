"""OpenAI tool calling, constrained by grammar (docs/tools.md).

formats.py   the call format (--tool-call-parser) and its system-prompt section
tools.py     validation of tools / tool_choice, the resolved request
prompt.py    tools and tool-call history into the chat template
grammar.py   the structural tag that constrains the calls
parser.py    calls out of the generated text (streaming and final)
protocol.py  response / delta shapes
serving.py   the glue the chat handler calls
"""
