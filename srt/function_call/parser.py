"""Tool calls out of generated text, incrementally (streaming) or at once (the same
parser fed the whole text, so both give the same calls), for every format of formats.py.

The grammar forces each call's literal parts, so the parser matches them exactly; text
that breaks the format after a trigger (e.g. a trigger the model wrote under
tool_choice=none) goes back to content. Whitespace right before a trigger, and after a
call unless more text follows, is dropped (it separates calls; it is not content). Text
that may be the start of the trigger is held back until it is known not to be.

JSON arguments stream as they are written; arguments in another style (Qwen3-Coder's XML,
pythonic keyword arguments) are rebuilt as JSON by the tool's schema once the call is whole
(constrained/arg_styles.py), so such a call's ``arguments`` appear at its end, in one piece.
"""
from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Optional

from constrained.arg_styles import ArgScanner, to_json_arguments
from srt.function_call.formats import ToolCallFormat

_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: str = "openai") -> str:
    if style == "mistral9":  # Mistral's templates refuse any other id
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # the arguments as JSON text: the model's own for JSON formats
    raw: str = ""  # the call's whole text (back to content if it never completes)
    complete: bool = False


@dataclass
class Delta:
    """What one feed adds: content text and/or call events. ``calls``: (index, id, name,
    arguments fragment); id and name are set only on a call's first event."""

    content: str = ""
    calls: list[tuple[int, Optional[str], Optional[str], str]] = field(default_factory=list)


class ToolCallParser:
    TEXT, HEAD, NAME, SEP, ARGS, END, BETWEEN = range(7)

    def __init__(self, fmt: ToolCallFormat, schemas: Optional[dict[str, dict]] = None) -> None:
        self.fmt, self.schemas = fmt, schemas or {}
        self.state = self.TEXT
        self.buf = ""  # unconsumed text of the current state
        self.after_call = False  # drop whitespace (and a separator) right after a call
        self.calls: list[ParsedCall] = []
        self.content = ""  # all content emitted so far
        self._name, self._raw = "", ""  # the call being read: its name, its text so far
        self._scan: Optional[ArgScanner] = None

    def feed(self, text: str) -> Delta:
        out = Delta()
        self.buf += text
        while self._step(out):
            pass
        self.content += out.content
        return out

    def finish(self) -> Delta:
        """End of the output: release held text. A call whose header never completed is
        content; one cut inside its arguments stays an incomplete call."""
        out = Delta()
        if self.state == self.TEXT and not self.after_call:
            out.content = self.buf
        elif self.state in (self.HEAD, self.NAME, self.SEP, self.BETWEEN):
            out.content = self._raw + self.buf
        else:  # ARGS / END: cut inside a call
            self.calls[-1].raw = self._raw + self.buf
        self.buf = ""
        self.content += out.content
        return out

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]

    def _step(self, out: Delta) -> bool:
        """Consume what the current state can; True to run again (the state changed)."""
        fmt = self.fmt
        if self.state == self.TEXT:
            return self._text(out)
        if self.state == self.HEAD:  # inside a wrapper: a call's fixed head
            return self._expect(fmt.call_begin, self.NAME, out)
        if self.state == self.NAME:
            buf, n = self.buf, 0
            while n < len(buf) and buf[n] in _NAME_CHARS:
                n += 1
            self._name, self._raw, self.buf = self._name + buf[:n], self._raw + buf[:n], buf[n:]
            if not self.buf:
                return False
            if not self._name:
                return self._malformed(out)
            self.state = self.SEP
            return True
        if self.state == self.SEP:
            return self._expect(fmt.args_begin, self.ARGS, out)
        if self.state == self.ARGS:
            return self._args(out)
        if self.state == self.END:
            return self._expect(fmt.call_end, self.BETWEEN if fmt.wrapped else self.TEXT, out)
        return self._between(out)

    def _text(self, out: Delta) -> bool:
        fmt, buf = self.fmt, self.buf
        if self.after_call:  # whitespace (and a separator) after a call is content only if text follows
            sep = fmt.separator.strip()
            if sep and not fmt.wrapped:
                rest = buf.lstrip()
                if sep.startswith(rest):
                    return False
                if rest.startswith(sep):
                    after = rest[len(sep):].lstrip()
                    if fmt.trigger.startswith(after):
                        return False
                    if after.startswith(fmt.trigger):
                        buf = self.buf = after
            if not buf.strip():
                return False
            self.after_call = False
        at = buf.find(fmt.trigger)
        if at >= 0:  # the whitespace before it joins the call's text (content if no call)
            text, after = buf[:at].rstrip(), at + len(fmt.trigger)
            out.content += text
            self._raw, self.buf = buf[len(text):after], buf[after:]
            self.state = self.HEAD if fmt.wrapped else self.NAME  # unwrapped: the trigger is the head
            return True
        keep = _held_back(buf, fmt.trigger)
        out.content += buf[:keep]
        self.buf = buf[keep:]
        return False

    def _expect(self, literal: str, nxt: int, out: Delta) -> bool:
        """The state's literal: wait while the buffer is a prefix of it, then move on."""
        n = min(len(literal), len(self.buf))
        if self.buf[:n] != literal[:n]:
            return self._malformed(out)
        if n < len(literal):
            return False
        self._raw += literal
        self.buf = self.buf[n:]
        if nxt == self.ARGS:
            call = ParsedCall(new_call_id(self.fmt.call_id_style), self._name)
            self.calls.append(call)
            self._scan = ArgScanner(self.fmt.args_style, self.fmt.call_end)
            out.calls.append((len(self.calls) - 1, call.id, call.name, ""))
        elif nxt in (self.TEXT, self.BETWEEN):
            self.calls[-1].complete, self.calls[-1].raw = True, self._raw
            self._name, self._raw, self.after_call = "", "", nxt == self.TEXT
        self.state = nxt
        return True

    def _args(self, out: Delta) -> bool:
        call, scan = self.calls[-1], self._scan
        taken, done = scan.feed(self.buf)
        if taken is None:
            return self._malformed(out)
        region, self.buf = self.buf[:taken], self.buf[taken:]
        self._raw += region
        if self.fmt.args_style == "json":
            if region.strip() or call.arguments:
                piece = region if call.arguments else region.lstrip()
                call.arguments += piece
                if piece:
                    out.calls.append((len(self.calls) - 1, None, None, piece))
        if not done:
            return False
        if self.fmt.args_style != "json":  # rebuilt whole by the schema's types
            args = to_json_arguments(self.fmt.args_style, scan.text, call.name, self.schemas.get(call.name))
            if args is None:
                return self._malformed(out)
            call.arguments = args
            out.calls.append((len(self.calls) - 1, None, None, args))
        self.state = self.END
        return True

    def _between(self, out: Delta) -> bool:
        """Inside a wrapper, after a call: the next call or the wrapper's end."""
        fmt, buf = self.fmt, self.buf
        nxt, end = fmt.separator + fmt.call_begin, fmt.calls_end
        if buf.startswith(nxt):
            self._raw, self.buf, self.state = nxt, buf[len(nxt):], self.NAME
            return True
        if buf.startswith(end):
            self.buf, self.state, self.after_call = buf[len(end):], self.TEXT, True
            return True
        if nxt.startswith(buf) or end.startswith(buf):  # (also an empty buffer) wait for more
            return False
        self.state, self.after_call = self.TEXT, False  # the wrapper broke off: text again
        return True

    def _malformed(self, out: Delta) -> bool:
        """Not a call after all: an unannounced call's text is content; an announced one
        stays incomplete. The rest is read as text again."""
        if self.state in (self.HEAD, self.NAME, self.SEP):
            out.content += self._raw
        else:
            self.calls[-1].raw = self._raw
        self._name, self._raw, self.state, self.after_call = "", "", self.TEXT, False
        return True


def _held_back(text: str, trigger: str) -> int:
    """Where to cut ``text`` so the rest (trailing whitespace, and a suffix that may begin
    the trigger) is held back."""
    cut = len(text)
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-k:]):
            cut = len(text) - k
            break
    return len(text[:cut].rstrip())
