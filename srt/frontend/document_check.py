"""The structured-output guarantee, in the frontend: what is refused before a request is sent
(an invalid schema, a strict one no grammar serves exactly) and what is checked when it ends
(each finished JSON document against its FULL schema, with jsonschema-rs).

- json_schema: a document of an approximate grammar (or of one whose formats the grammar
  checks only for syntax: schema_coverage.needs_format_check) that the grammar completed
  (EOS, not a stop string or max_tokens).
- structural_tag (tool calls are one): every completed part -- its ``begin``, a whole JSON
  value, one of its ``end``s -- whatever the grammar, and whatever ended the output, since a
  completed tool call is returned as a call even when ``max_tokens`` cut the text after it.
  Microseconds a document: one cached validator per schema.
A violation is never reported as a success: the caller turns it into the finish reason
``schema_violation``.
"""
from __future__ import annotations

import json
from typing import Optional

from constrained.grammar_config import JsonOptions
from constrained.schema_coverage import GrammarReport, needs_format_check
from constrained.schema_validation import SchemaValidators, SchemaViolation
from constrained.strict_check import check_strict
from constrained.tag_parts import find_documents, tag_parts


class DocumentChecker:
    def __init__(self, server_args, think_end: Optional[str]) -> None:
        self.backend = server_args.grammar_backend
        self.json_options = JsonOptions.from_server_args(server_args)  # as the ranks' backends
        self.validators = SchemaValidators()
        self.think_end = think_end

    def check_request(self, params) -> None:
        """ValueError (a 400) for an invalid schema anywhere in the constraint, or a strict
        one the server's grammar backend cannot serve exactly."""
        if params.json_schema is not None:  # only a schema that is itself invalid is refused
            self.validators.check_schema(params.json_schema)
        if params.structural_tag is not None:
            for part in tag_parts(json.loads(params.structural_tag)):
                try:
                    self.validators.check_schema(json.dumps(part.schema))
                except ValueError as e:
                    raise ValueError(f"structural_tag part {part.name}: {e}") from None
        check_strict(params.json_schema, params.structural_tag, self.backend, self.json_options)

    def check_finished(self, params, report: GrammarReport, reason, text: str,
                       require_reasoning: bool) -> tuple[Optional[dict], bool]:
        """(the violation as a finish-reason dict, or None; whether a document was checked)."""
        if require_reasoning and self.think_end:
            text = text.rsplit(self.think_end, 1)[-1]  # the constraint starts after thinking
        if params.json_schema is not None:
            return self._json_document(params.json_schema, report, reason, text)
        if params.structural_tag is not None and reason.type != "abort":
            return self._tag_documents(params.structural_tag, text)
        return None, False

    def _json_document(self, schema: str, report: GrammarReport, reason, text: str):
        if report.exact and not needs_format_check(schema):
            return None, False  # exact grammars pay no validation
        if reason.type != "stop" or isinstance(reason.matched, str):
            return None, False  # not a document the grammar completed
        return _as_dict(self._validate(schema, text)), True

    def _tag_documents(self, tag: str, text: str):
        checked = False
        for part, document in find_documents(text, tag_parts(json.loads(tag))):
            checked = True
            violation = self._validate(json.dumps(part.schema), document)
            if violation is not None:
                return {**violation.to_json(), "part": part.name}, True
        return None, checked

    def _validate(self, schema: str, document: str) -> Optional[SchemaViolation]:
        try:
            return self.validators.validate(schema, document)
        except ValueError as e:  # a schema the validator cannot build: say so, never "valid"
            return SchemaViolation(f"The schema could not be validated: {e}", "schema", "#", "#")


def _as_dict(violation: Optional[SchemaViolation]) -> Optional[dict]:
    return None if violation is None else violation.to_json()
