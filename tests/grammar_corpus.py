"""A corpus of grammar-constrained generation cases, with independent validators.

Not a test module: ``tests/test_constrained_generation.py`` runs the corpus through the real
server, and the offline self-checks below (``check_*``) prove that every spec compiles with
the grammar libraries and that every validator can both pass and fail.

Each :class:`Case` has a kind (``json_schema`` | ``regex`` | ``ebnf``), the spec sent to the
server, chat ``messages`` that steer SmolLM2-135M-Instruct towards a short answer (the grammar
forces the format anyway), a ``max_tokens`` budget large enough for the grammar to finish, and
a validator that does NOT reuse the grammar libraries:

* json_schema: ``json.loads`` + ``jsonschema`` (the schema's own draft, else 2020-12);
* regex: Python ``re.fullmatch`` on the spec (the specs stay in the syntax that Python, xgrammar
  and llguidance read alike);
* ebnf: the same language written a second time, by hand, as a Lark grammar (or as a Python
  regex where the language is regular), and parsed with it.

``xgrammar_ok=False`` marks schemas whose features xgrammar is known to mishandle (oneOf,
allOf, length bounds next to a pattern): it may compile them, but into a wrong language, so
those cases are only for the llguidance backend and for ``auto`` (which routes them to
llguidance).

Run ``python tests/grammar_corpus.py`` for the offline self-check (needs the embedded model's
tokenizer: ``srt.model_executor.model_loader.resolve_model_path(None)``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional

VOCAB_SIZE = 49152  # SmolLM2's embedding rows (== len(tokenizer))
KINDS = ("json_schema", "regex", "ebnf")


@dataclass
class Case:
    name: str
    kind: str  # "json_schema" | "regex" | "ebnf"
    spec: Any  # dict (json_schema) or str
    prompt: str  # the user message
    example_valid: str
    example_invalid: str
    max_tokens: int = 64
    # ebnf only: the independent re-statement of the language (exactly one of the two)
    lark: Optional[str] = None
    pyregex: Optional[str] = None
    xgrammar_ok: bool = True  # False: xgrammar mishandles a feature; llguidance/auto only
    llguidance_ok: bool = True
    system: Optional[str] = None
    notes: str = ""
    _validator: Optional[Callable[[str], None]] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        if self.kind == "ebnf":
            assert (self.lark is None) != (self.pyregex is None), f"{self.name}: lark xor pyregex"

    # ---- what goes on the wire -------------------------------------------------------------
    @property
    def messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.prompt}]

    @property
    def spec_str(self) -> str:
        return json.dumps(self.spec) if self.kind == "json_schema" else self.spec

    def supported_by(self, backend: str) -> bool:
        """backend: "xgrammar" | "llguidance" | "auto"."""
        if backend == "xgrammar":
            return self.xgrammar_ok
        if backend == "llguidance":
            return self.llguidance_ok
        return self.xgrammar_ok or self.llguidance_ok

    # ---- validation ------------------------------------------------------------------------
    def validate(self, text: str) -> None:
        """Raise (AssertionError / ValueError / jsonschema.ValidationError / lark error) when
        ``text`` is not a sentence of the case's language."""
        self.validator(text)

    def is_valid(self, text: str) -> bool:
        try:
            self.validate(text)
        except Exception:
            return False
        return True

    def why_invalid(self, text: str) -> Optional[str]:
        try:
            self.validate(text)
        except Exception as e:  # noqa: BLE001 - a report, not control flow
            return f"{type(e).__name__}: {str(e)[:300]}"
        return None

    @cached_property
    def validator(self) -> Callable[[str], None]:
        if self.kind == "json_schema":
            import jsonschema

            cls = jsonschema.validators.validator_for(self.spec, default=jsonschema.Draft202012Validator)
            cls.check_schema(self.spec)
            v = cls(self.spec)

            def check(text: str) -> None:
                v.validate(json.loads(text))

            return check
        if self.kind == "regex":
            rx = re.compile(self.spec)

            def check(text: str) -> None:
                if rx.fullmatch(text) is None:
                    raise AssertionError(f"no full match for /{self.spec}/")

            return check
        if self.pyregex is not None:
            rx = re.compile(self.pyregex)

            def check(text: str) -> None:
                if rx.fullmatch(text) is None:
                    raise AssertionError(f"no full match for the re-statement /{self.pyregex}/")

            return check
        from lark import Lark

        parser = Lark(self.lark, start="start", parser="earley", lexer="dynamic_complete")

        def check(text: str) -> None:
            parser.parse(text)

        return check


def _schema(name, schema, prompt, valid, invalid, max_tokens=64, **kw) -> Case:
    return Case(name, "json_schema", schema, prompt, json.dumps(valid) if not isinstance(valid, str) else valid,
                json.dumps(invalid) if not isinstance(invalid, str) else invalid, max_tokens=max_tokens, **kw)


def _obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


def _str(max_len=20, **extra) -> dict:
    return {"type": "string", "maxLength": max_len, **extra}


# =============================================================================================
# JSON schemas
# =============================================================================================
JSON_CASES = [
    _schema("person_basic",
            _obj({"name": _str(20), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
            "Describe Alice, who is 30 years old, as JSON with the keys name and age.",
            {"name": "Alice", "age": 30}, {"name": "Alice", "age": 130}),
    _schema("nested_address",
            _obj({"name": _str(20),
                  "address": _obj({"street": _str(30), "city": _str(20),
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
            "Give Bob's contact as JSON: name, and an address with street, city and a 5-digit zip.",
            {"name": "Bob", "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}},
            {"name": "Bob", "address": {"street": "1 Main St", "city": "Springfield", "zip": "1234"}},
            max_tokens=96),
    _schema("array_tags",
            _obj({"tags": {"type": "array", "items": _str(12), "minItems": 1, "maxItems": 3}}),
            "List up to three tags for a blog post about cooking pasta, as JSON with the key tags.",
            {"tags": ["pasta", "cooking"]}, {"tags": []}),
    _schema("enum_color",
            _obj({"color": {"enum": ["red", "green", "blue"]}}),
            "What color is the sky on a clear day? Answer as JSON with the key color.",
            {"color": "blue"}, {"color": "purple"}, max_tokens=32),
    _schema("anyof_id",
            _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999},
                                   {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}]}}),
            "Give the order id 4521 as JSON with the key id.",
            {"id": "AB123"}, {"id": 1.5}, max_tokens=32),
    _schema("ref_defs",
            {"$defs": {"point": _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                      "y": {"type": "integer", "minimum": -100, "maximum": 100}})},
             **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
            "A line segment goes from (0, 0) to (3, 4). Give it as JSON with start and end points.",
            {"start": {"x": 0, "y": 0}, "end": {"x": 3, "y": 4}},
            {"start": {"x": 0, "y": 0}, "end": {"x": 3}}, max_tokens=80),
    _schema("date_pattern",
            _obj({"event": _str(24), "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}}),
            "The moon landing happened on July 20, 1969. Give it as JSON with the keys event and date.",
            {"event": "Moon landing", "date": "1969-07-20"}, {"event": "Moon landing", "date": "July 20"},
            max_tokens=64),
    _schema("number_range",
            _obj({"city": _str(20), "temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
            "It is 21.5 degrees Celsius in Paris. Give it as JSON with the keys city and temperature.",
            {"city": "Paris", "temperature": 21.5}, {"city": "Paris", "temperature": 99.0}),
    _schema("integer_score",
            _obj({"score": {"type": "integer", "minimum": 1, "maximum": 10}}),
            "Rate the movie Titanic from 1 to 10 as JSON with the key score.",
            {"score": 8}, {"score": 11}, max_tokens=24),
    _schema("boolean_reason",
            _obj({"is_even": {"type": "boolean"}, "reason": _str(40)}),
            "Is 12 an even number? Answer as JSON with the keys is_even and reason.",
            {"is_even": True, "reason": "12 is divisible by 2"}, {"is_even": "yes", "reason": "ok"},
            max_tokens=64),
    _schema("const_version",
            _obj({"version": {"const": "1.0"}, "ok": {"type": "boolean"}}),
            "Report a status as JSON with version 1.0 and ok true.",
            {"version": "1.0", "ok": True}, {"version": "2.0", "ok": True}, max_tokens=32),
    _schema("optional_fields",
            _obj({"title": _str(30), "subtitle": _str(30), "pages": {"type": "integer", "minimum": 1,
                                                                       "maximum": 5000}},
                 required=["title"]),
            "Describe the book 'Dune' as JSON with a title and the number of pages.",
            {"title": "Dune", "pages": 412}, {"subtitle": "A novel", "pages": 412}, max_tokens=64),
    _schema("array_of_objects",
            _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                            "items": _obj({"name": _str(15), "qty": {"type": "integer", "minimum": 1,
                                                                     "maximum": 99}})}}),
            "A shopping list: 2 apples and 1 bread. Give it as JSON with a list of items (name, qty).",
            {"items": [{"name": "apple", "qty": 2}, {"name": "bread", "qty": 1}]},
            {"items": [{"name": "apple", "qty": 0}]}, max_tokens=96),
    _schema("top_level_int_array",
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000},
             "minItems": 3, "maxItems": 5},
            "List the first four square numbers as a JSON array.",
            [1, 4, 9, 16], [1, 4], max_tokens=40),
    _schema("top_level_enum_string",
            {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "What is the sentiment of 'I love this phone!'? Answer with one JSON string.",
            '"positive"', '"happy"', max_tokens=16),
    _schema("nullable_field",
            _obj({"first": _str(12), "middle": {"type": ["string", "null"], "maxLength": 12},
                  "last": _str(12)}),
            "Split the name 'John Smith' into first, middle and last as JSON (middle is null).",
            {"first": "John", "middle": None, "last": "Smith"},
            {"first": "John", "middle": 3, "last": "Smith"}, max_tokens=64),
    _schema("matrix_2x2",
            _obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                             "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                       "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}),
            "Give the 2x2 identity matrix as JSON with the key matrix.",
            {"matrix": [[1, 0], [0, 1]]}, {"matrix": [[1, 0, 0], [0, 1]]}, max_tokens=48),
    _schema("recursive_tree",
            {"$defs": {"node": _obj({"name": _str(10),
                                     "children": {"type": "array", "maxItems": 2,
                                                  "items": {"$ref": "#/$defs/node"}}},
                                    required=["name"])},
             "$ref": "#/$defs/node"},
            "Give a tiny family tree as JSON: Ann has one child, Tom, and Tom has no children.",
            {"name": "Ann", "children": [{"name": "Tom"}]},
            {"name": "Ann", "children": [{"age": 3}]}, max_tokens=96),
    _schema("email_pattern",
            _obj({"user": _str(16), "email": {"type": "string",
                                              "pattern": r"^[a-z]{1,12}@[a-z]{2,10}\.(com|org)$"}}),
            "Make up a user named sam with an email address at example.com, as JSON.",
            {"user": "sam", "email": "sam@example.com"}, {"user": "sam", "email": "sam@example"},
            max_tokens=48),
    _schema("integer_enum_priority",
            _obj({"task": _str(24), "priority": {"type": "integer", "enum": [1, 2, 3]}}),
            "Create a task 'fix the roof' with priority 1 as JSON with the keys task and priority.",
            {"task": "fix the roof", "priority": 1}, {"task": "fix the roof", "priority": 4}),
    _schema("draft7_definitions",
            {"$schema": "http://json-schema.org/draft-07/schema#",
             "definitions": {"money": _obj({"amount": {"type": "number", "minimum": 0, "maximum": 100000},
                                            "currency": {"enum": ["USD", "EUR", "GBP"]}})},
             **_obj({"item": _str(20), "price": {"$ref": "#/definitions/money"}})},
            "A coffee costs 3.5 US dollars. Give it as JSON with the keys item and price.",
            {"item": "coffee", "price": {"amount": 3.5, "currency": "USD"}},
            {"item": "coffee", "price": {"amount": 3.5, "currency": "YEN"}}, max_tokens=80),
    _schema("product_mixed",
            _obj({"sku": {"type": "string", "pattern": r"^[A-Z]{3}-\d{3}$"},
                  "price": {"type": "number", "minimum": 0, "maximum": 1000},
                  "in_stock": {"type": "boolean"},
                  "category": {"enum": ["book", "toy", "food"]}}),
            "Describe a product as JSON: sku ABC-123, price 9.99, in stock, category toy.",
            {"sku": "ABC-123", "price": 9.99, "in_stock": True, "category": "toy"},
            {"sku": "abc-123", "price": 9.99, "in_stock": True, "category": "toy"}, max_tokens=80),
    _schema("exclusive_bounds",
            _obj({"probability": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                  "label": _str(10)}),
            "Give the probability 0.75 that it rains tomorrow, as JSON with the keys probability and label.",
            {"probability": 0.75, "label": "rain"}, {"probability": 1, "label": "rain"}, max_tokens=48),
    _schema("string_array_enum_items",
            _obj({"days": {"type": "array", "minItems": 1, "maxItems": 3,
                           "items": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}}}),
            "Which days are the weekend? Answer as JSON with the key days.",
            {"days": ["Sat", "Sun"]}, {"days": ["Saturday"]}, max_tokens=40),
    # ---- features xgrammar is known to mishandle: llguidance / auto only ---------------------
    _schema("oneof_pet",
            _obj({"pet": {"oneOf": [_obj({"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}}),
                                    _obj({"kind": {"const": "dog"}, "good": {"type": "boolean"}})]}}),
            "Describe a pet dog that is a good boy, as JSON with the key pet.",
            {"pet": {"kind": "dog", "good": True}}, {"pet": {"kind": "dog", "lives": 3}}, max_tokens=48,
            xgrammar_ok=False, notes="oneOf"),
    _schema("allof_merge",
            {"allOf": [{"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                        "required": ["id"]},
                       {"type": "object", "properties": {"label": _str(12)}, "required": ["label"]}],
             "properties": {"id": {}, "label": {}}, "additionalProperties": False},
            "Give item 7 labelled 'spoon' as JSON with the keys id and label.",
            {"id": 7, "label": "spoon"}, {"id": 7}, max_tokens=40, xgrammar_ok=False, notes="allOf"),
    _schema("pattern_with_length",
            _obj({"code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 6}}),
            "Give a short lowercase code word as JSON with the key code.",
            {"code": "alpha"}, {"code": "alphabetical"}, max_tokens=32, xgrammar_ok=False,
            notes="minLength/maxLength next to pattern"),
]


# =============================================================================================
# Regexes (the common syntax of Python re, xgrammar and llguidance/Rust regex)
# =============================================================================================
def _regex(name, spec, prompt, valid, invalid, max_tokens=32, **kw) -> Case:
    return Case(name, "regex", spec, prompt, valid, invalid, max_tokens=max_tokens, **kw)


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
REGEX_CASES = [
    _regex("iso_date", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
           "What is the date of the first moon landing? Answer in YYYY-MM-DD format.",
           "1969-07-20", "1969-13-20", max_tokens=16),
    _regex("us_phone", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
           "Make up a US phone number in the format (555) 123-4567.",
           "(555) 123-4567", "555-123-4567", max_tokens=20),
    _regex("email", r"[a-z]{1,10}(\.[a-z]{1,10})?@[a-z]{2,10}\.(com|org|net)",
           "Write an email address for John Doe at example.com.",
           "john.doe@example.com", "john doe@example.com", max_tokens=24),
    _regex("ipv4", rf"({_OCTET}\.){{3}}{_OCTET}",
           "What is the IP address of the local loopback interface?",
           "127.0.0.1", "256.0.0.1", max_tokens=16),
    _regex("yes_no_maybe", r"(yes|no|maybe)",
           "Is the earth round? Answer yes, no or maybe.",
           "yes", "Yes", max_tokens=8),
    _regex("time_24h", r"([01][0-9]|2[0-3]):[0-5][0-9]",
           "What time is noon in 24-hour format (HH:MM)?",
           "12:00", "24:00", max_tokens=12),
    _regex("hex_color", r"#[0-9a-fA-F]{6}",
           "What is the hex color code of pure red?",
           "#FF0000", "#FF00", max_tokens=12),
    _regex("short_sentence", r"[A-Z][a-z]{1,10}( [a-z]{1,10}){2,5}\.",
           "Describe a cat in one short sentence.",
           "Cats like to sleep.", "cats like to sleep.", max_tokens=24),
    _regex("zip_code", r"[0-9]{5}(-[0-9]{4})?",
           "Give a US zip code for Beverly Hills.",
           "90210", "9021", max_tokens=12),
    _regex("semver", r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})",
           "Give a version number in semantic versioning format.",
           "1.2.3", "01.2.3", max_tokens=12),
    _regex("money", r"\$[1-9][0-9]{0,3}\.[0-9]{2}",
           "How much does a cup of coffee cost in dollars?",
           "$3.50", "$3.5", max_tokens=12),
    _regex("number_list", r"[0-9]{1,3}(, [0-9]{1,3}){2,5}",
           "List the first five even numbers separated by commas.",
           "2, 4, 6, 8, 10", "2, 4", max_tokens=24),
    _regex("multiple_choice", r"Answer: (A|B|C|D)",
           "Which planet is the largest? A) Mars B) Jupiter C) Venus D) Earth",
           "Answer: B", "Answer: E", max_tokens=8),
    _regex("url", r"https://(www\.)?[a-z]{3,12}\.(com|org|io)(/[a-z]{1,8}){0,2}",
           "What is the URL of the Hugging Face website?",
           "https://www.huggingface.com/models", "http://huggingface.co", max_tokens=24),
    _regex("temperature_unit", r"-?[0-9]{1,3}(\.[0-9])? ?(C|F)",
           "What is the boiling point of water in Celsius?",
           "100 C", "100 K", max_tokens=12),
]


# =============================================================================================
# EBNF (GBNF / xgrammar style), each re-stated independently as Lark or a Python regex
# =============================================================================================
def _ebnf(name, spec, prompt, valid, invalid, max_tokens=48, **kw) -> Case:
    return Case(name, "ebnf", spec.strip() + "\n", prompt, valid, invalid, max_tokens=max_tokens, **kw)


EBNF_CASES = [
    _ebnf("arithmetic",
          r'''
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
''',
          "Write a short arithmetic expression that equals 10, like 2*(3+2).",
          "12*(3+2)-50", "2*(3+2", max_tokens=64,
          lark=r'''
start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{1,2}|[0-9]/
'''),
    _ebnf("word_list",
          r'''
root ::= "[" item (", " item){0,4} "]"
item ::= [a-z]{1,10}
''',
          "List some fruits in square brackets, separated by commas.",
          "[apple, banana, cherry]", "[apple,banana]", max_tokens=40,
          pyregex=r"\[[a-z]{1,10}(, [a-z]{1,10}){0,4}\]"),
    _ebnf("key_value_pairs",
          r'''
root ::= pair (";" pair){0,3}
pair ::= key "=" value
key ::= [a-z_]{1,10}
value ::= [0-9]{1,5} | "\"" [a-zA-Z ]{0,16} "\""
''',
          "Write a config line with key=value pairs separated by semicolons: host, port and user.",
          'host="localhost";port=8080;user="admin"', 'host=localhost;port=8080', max_tokens=40,
          lark=r'''
start: pair (";" pair)~0..3
pair: KEY "=" value
KEY: /[a-z_]{1,10}/
value: /[0-9]{1,5}/ | /"[a-zA-Z ]{0,16}"/
'''),
    _ebnf("json_subset",
          r'''
root ::= object
object ::= "{" ws ( member ( "," ws member ){0,3} )? ws "}"
member ::= string ":" ws value
value ::= string | number | "true" | "false" | "null" | array
array ::= "[" ( value ( ", " value ){0,3} )? "]"
string ::= "\"" [a-zA-Z0-9 ]{0,12} "\""
number ::= "-"? [0-9]{1,4} ("." [0-9]{1,2})?
ws ::= " "?
''',
          "Describe a laptop as a small JSON object with brand, price and a list of colors.",
          '{"brand": "Acme", "price": 999.99, "colors": ["black", "silver"]}',
          '{"brand": "Acme", "price": 999.999}', max_tokens=64,
          lark=r'''
start: object
object: "{" WS? (member ("," WS? member)~0..3)? WS? "}"
member: STRING ":" WS? value
?value: STRING | NUMBER | "true" | "false" | "null" | array
array: "[" (value (", " value)~0..3)? "]"
STRING: /"[a-zA-Z0-9 ]{0,12}"/
NUMBER: /-?[0-9]{1,4}(\.[0-9]{1,2})?/
WS: " "
'''),
    _ebnf("yes_no_because",
          r'''
root ::= answer ", because " reason "."
answer ::= "Yes" | "No"
reason ::= [a-z] [a-z ]{3,40}
''',
          "Is water wet? Answer Yes or No and give a short reason.",
          "Yes, because it is a liquid.", "Yes because it is a liquid.", max_tokens=32,
          pyregex=r"(Yes|No), because [a-z][a-z ]{3,40}\."),
    _ebnf("greeting",
          r'''
root ::= "Hello, " name "!"
name ::= [A-Z] [a-z]+
''',
          "Greet a person named Maria.",
          "Hello, Maria!", "Hello, maria!", max_tokens=16,
          pyregex=r"Hello, [A-Z][a-z]+!"),
    _ebnf("boolean_expression",
          r'''
root ::= disj
disj ::= conj (" or " conj){0,3}
conj ::= atom (" and " atom){0,3}
atom ::= "true" | "false" | "not " atom | "(" disj ")"
''',
          "Write a boolean expression using true, false, and, or, not that evaluates to true.",
          "not false and (true or false)", "true and or false", max_tokens=32,
          lark=r'''
start: disj
disj: conj (" or " conj)~0..3
conj: atom (" and " atom)~0..3
atom: "true" | "false" | "not " atom | "(" disj ")"
'''),
    _ebnf("date_in_words",
          r'''
root ::= month " " day ", " year
month ::= "January" | "February" | "March" | "April" | "May" | "June" | "July" | "August" | "September" | "October" | "November" | "December"
day ::= [1-9] | [12] [0-9] | "3" [01]
year ::= [12] [0-9] [0-9] [0-9]
''',
          "When did the first man walk on the moon? Give the date in words like 'July 20, 1969'.",
          "July 20, 1969", "Jul 20, 1969", max_tokens=16,
          pyregex=r"(January|February|March|April|May|June|July|August|September|October|November|December)"
                  r" ([1-9]|[12][0-9]|3[01]), [12][0-9]{3}"),
    _ebnf("sql_select",
          r'''
root ::= "SELECT " columns " FROM " ident where? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " ident " " op " " number
op ::= "=" | "<" | ">"
ident ::= [a-z] [a-z_]{0,11}
number ::= [0-9]{1,6}
''',
          "Write a SQL query that selects the names of users older than 30.",
          "SELECT name FROM users WHERE age > 30;", "SELECT name FROM users WHERE age >= 30;",
          max_tokens=40,
          lark=r'''
start: "SELECT " columns " FROM " IDENT where? ";"
columns: "*" | IDENT (", " IDENT)*
where: " WHERE " IDENT " " OP " " NUMBER
OP: "=" | "<" | ">"
IDENT: /[a-z][a-z_]{0,11}/
NUMBER: /[0-9]{1,6}/
'''),
    _ebnf("function_call",
          r'''
root ::= ident "(" args? ")"
args ::= arg (", " arg)*
arg ::= number | string | ident "=" (number | string)
ident ::= [a-z_] [a-z0-9_]{0,15}
number ::= "-"? [0-9]{1,6}
string ::= "'" [a-zA-Z ]* "'"
''',
          "Write a Python call of the function get_weather for the city 'Paris' with days=3.",
          "get_weather('Paris', days=3)", "get_weather('Paris', days=3", max_tokens=32,
          lark=r'''
start: IDENT "(" args? ")"
args: arg (", " arg)*
arg: NUMBER | STRING | IDENT "=" (NUMBER | STRING)
IDENT: /[a-z_][a-z0-9_]{0,15}/
NUMBER: /-?[0-9]{1,6}/
STRING: /'[a-zA-Z ]*'/
'''),
    _ebnf("csv_rows",
          r'''
root ::= header ("\n" row){1,3}
header ::= "name,age,city"
row ::= [A-Z] [a-z]{1,9} "," [0-9]{1,2} "," [A-Z] [a-z]{1,11}
''',
          "Write a CSV table with the header name,age,city and two rows of people.",
          "name,age,city\nAnna,31,Berlin\nBen,25,Rome", "name,age,city\nAnna,31", max_tokens=48,
          pyregex=r"name,age,city(\n[A-Z][a-z]{1,9},[0-9]{1,2},[A-Z][a-z]{1,11}){1,3}"),
    _ebnf("bullet_list",
          r'''
root ::= item{2,4}
item ::= "- " [A-Z] [a-z ]{1,24} "\n"
''',
          "Give three tips for better sleep as a bullet list.",
          "- Sleep early\n- Avoid coffee\n", "- Sleep early\n", max_tokens=48,
          pyregex=r"(- [A-Z][a-z ]{1,24}\n){2,4}"),
    _ebnf("robot_command",
          r'''
root ::= command (" then " command)?
command ::= "move " direction " " steps | "turn " side | "stop"
direction ::= "forward" | "backward"
side ::= "left" | "right"
steps ::= [1-9]
''',
          "Give a robot a command to go forward 3 steps and then turn left.",
          "move forward 3 then turn left", "move up 3", max_tokens=16,
          lark=r'''
start: command (" then " command)?
command: "move " DIRECTION " " STEPS | "turn " SIDE | "stop"
DIRECTION: "forward" | "backward"
SIDE: "left" | "right"
STEPS: /[1-9]/
'''),
    _ebnf("equation",
          r'''
root ::= num " x " num " = " num
num ::= [1-9] [0-9]?
''',
          "What is 7 times 8? Write it as an equation like '2 x 3 = 6'.",
          "7 x 8 = 56", "7 * 8 = 56", max_tokens=16,
          pyregex=r"[1-9][0-9]? x [1-9][0-9]? = [1-9][0-9]?"),
    _ebnf("http_headers",
          r'''
root ::= header{1,2}
header ::= name ": " value "\r\n"
name ::= [A-Z] [a-zA-Z-]{1,15}
value ::= [a-zA-Z0-9/.;= -]{1,16}
''',
          "Write two HTTP request headers: Host is example.com and Accept is text/html.",
          "Host: example.com\r\nAccept: text/html\r\n", "Host example.com\r\n", max_tokens=64,
          lark=r'''
start: header~1..2
header: NAME ": " VALUE "\r\n"
NAME: /[A-Z][a-zA-Z\-]{1,15}/
VALUE: /[a-zA-Z0-9\/.;= \-]{1,16}/
'''),
]

CASES: list[Case] = JSON_CASES + REGEX_CASES + EBNF_CASES
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "duplicate case names"


def cases_for(backend: str) -> list[Case]:
    """The cases a server with ``--grammar-backend backend`` should serve correctly."""
    return [c for c in CASES if c.supported_by(backend)]


def counts() -> dict[str, int]:
    out = {k: 0 for k in KINDS}
    for c in CASES:
        out[c.kind] += 1
    return out


# =============================================================================================
# Offline self-checks (no server): each returns {case name: problem} for the failures
# =============================================================================================
def check_examples(cases=None) -> dict[str, str]:
    """Every validator accepts its ``example_valid`` and rejects its ``example_invalid``."""
    bad = {}
    for c in cases or CASES:
        why = c.why_invalid(c.example_valid)
        if why is not None:
            bad[c.name] = f"example_valid rejected: {why}"
        elif c.is_valid(c.example_invalid):
            bad[c.name] = "example_invalid accepted"
    return bad


def xgrammar_compiler(tokenizer):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE)
    return xgrammar.GrammarCompiler(info)


def xgrammar_compile(compiler, case: Case):
    if case.kind == "json_schema":
        return compiler.compile_json_schema(case.spec_str)
    if case.kind == "regex":
        return compiler.compile_regex(case.spec)
    return compiler.compile_grammar(case.spec)


def llguidance_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE)


def llguidance_grammar(case: Case) -> str:
    import llguidance

    return llguidance.grammar_from({"json_schema": "json", "regex": "regex", "ebnf": "ebnf"}[case.kind],
                                   case.spec_str)


def check_xgrammar(tokenizer, cases=None, accept_examples: bool = True) -> dict[str, str]:
    """Every (xgrammar_ok) spec compiles with xgrammar; its grammar accepts ``example_valid``
    (then the stop token)."""
    import xgrammar

    compiler = xgrammar_compiler(tokenizer)
    bad = {}
    for c in cases or [c for c in CASES if c.xgrammar_ok]:
        try:
            compiled = xgrammar_compile(compiler, c)
        except Exception as e:  # noqa: BLE001
            bad[c.name] = f"compile: {e}"
            continue
        if accept_examples:
            m = xgrammar.GrammarMatcher(compiled)
            ok = m.accept_string(c.example_valid) and m.accept_token(tokenizer.eos_token_id)
            if not ok:
                bad[c.name] = "grammar rejects example_valid"
    return bad


def check_llguidance(tokenizer, cases=None, accept_examples: bool = True) -> dict[str, str]:
    """Every (llguidance_ok) spec validates with llguidance, with no warnings; a matcher fed
    ``example_valid`` ends up accepting."""
    import llguidance

    lltok = llguidance_tokenizer(tokenizer)
    bad = {}
    for c in cases or [c for c in CASES if c.llguidance_ok]:
        try:
            grammar = llguidance_grammar(c)
        except Exception as e:  # noqa: BLE001
            bad[c.name] = f"convert: {e}"
            continue
        is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_err or msgs:
            bad[c.name] = f"validate: {msgs}"
            continue
        m = llguidance.LLMatcher(lltok, grammar)
        if m.get_error():
            bad[c.name] = f"matcher: {m.get_error()}"
            continue
        if accept_examples:
            ids = tokenizer.encode(c.example_valid, add_special_tokens=False)
            if not (m.consume_tokens(ids) and m.is_accepting()):
                bad[c.name] = f"grammar rejects example_valid: {m.get_error()}"
    return bad


class PrefixChecker:
    """Is a truncated output (finish_reason "length") a prefix of some sentence of the case's
    language? Asked of llguidance (JSON with flexible whitespace), which enforces every
    corpus feature; for the xgrammar server that is a second library's opinion."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lltok = llguidance_tokenizer(tokenizer)

    def why_not_prefix(self, case: Case, text: str) -> Optional[str]:
        import llguidance

        m = llguidance.LLMatcher(self.lltok, llguidance_grammar(case))
        if not m.consume_tokens(self.tokenizer.encode(text, add_special_tokens=False)):
            return f"not a prefix of the language: {m.get_error()[:300]}"
        return None


def self_check(tokenizer) -> dict[str, dict[str, str]]:
    return {"examples": check_examples(), "xgrammar": check_xgrammar(tokenizer),
            "llguidance": check_llguidance(tokenizer)}


if __name__ == "__main__":
    import os
    import sys
    import time

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from transformers import AutoTokenizer

    from srt.model_executor.model_loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    t0 = time.time()
    report = self_check(tok)
    print(f"{len(CASES)} cases {counts()}; xgrammar_ok=False: "
          f"{[c.name for c in CASES if not c.xgrammar_ok]}; {time.time() - t0:.1f} s")
    for part, bad in report.items():
        print(f"{part}: {'OK' if not bad else ''}")
        for name, why in bad.items():
            print(f"  {name}: {why}")
    sys.exit(1 if any(report.values()) else 0)
