"""Tool calls out of generated text, incrementally (streaming) or at once (the same
parser fed the whole text, so both give the same calls).

The grammar forces each call's literal parts, so the parser matches them exactly; text
that breaks the format after a trigger (e.g. a trigger the model wrote under
tool_choice=none) goes back to content. Whitespace right before a trigger, and after a
call unless more text follows, is dropped (it separates calls; it is not content). Text
that may be the start of the trigger is held back until it is known not to be.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

from srt.function_call.formats import ToolCallFormat

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # the model's JSON text, as generated
    raw: str = ""  # the call's whole text (back to content if it never completes)
    complete: bool = False


@dataclass
class Delta:
    """What one feed adds: content text and/or call events. ``calls``: (index, id, name,
    arguments fragment); id and name are set only on a call's first event."""

    content: str = ""
    calls: list[tuple[int, Optional[str], Optional[str], str]] = field(default_factory=list)


class ToolCallParser:
    TEXT, HEAD, NAME, SEP, ARGS, END = range(6)

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.state = self.TEXT
        self.buf = ""  # unconsumed text of the current state
        self.after_call = False  # drop whitespace right after a call
        self.calls: list[ParsedCall] = []
        self.content = ""  # all content emitted so far
        self._name, self._raw = "", ""  # the call being read: its name, its text so far
        self._depth, self._in_str, self._esc = 0, False, False

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
        elif self.state in (self.HEAD, self.NAME, self.SEP):
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
        fmt, buf = self.fmt, self.buf
        if self.state == self.TEXT:
            if self.after_call:  # whitespace after a call is content only if text follows
                if not buf.strip():
                    return False
                self.after_call = False
            at = buf.find(fmt.trigger)
            if at >= 0:  # the whitespace before it joins the call's text (content if no call)
                text, after = buf[:at].rstrip(), at + len(fmt.trigger)
                out.content += text
                self._raw, self.buf, self.state = buf[len(text):after], buf[after:], self.HEAD
                return True
            keep = _held_back(buf, fmt.trigger)
            out.content += buf[:keep]
            self.buf = buf[keep:]
            return False
        if self.state == self.HEAD:
            return self._expect(fmt.begin[len(fmt.trigger):], self.NAME, out)
        if self.state == self.NAME:
            n = 0
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
        return self._expect(fmt.end, self.TEXT, out)  # END

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
            call = ParsedCall(new_call_id(), self._name)
            self.calls.append(call)
            out.calls.append((len(self.calls) - 1, call.id, call.name, ""))
        elif nxt == self.TEXT:
            self.calls[-1].complete, self.calls[-1].raw = True, self._raw
            self._name, self._raw, self.after_call = "", "", True
        self.state = nxt
        return True

    def _args(self, out: Delta) -> bool:
        """Stream the arguments up to their matching close bracket (strings aware)."""
        call, buf, start = self.calls[-1], self.buf, 0
        if not call.arguments:  # skip whitespace before the value
            start = len(buf) - len(buf.lstrip())
            if start == len(buf):
                self.buf = ""
                return False
            if buf[start] not in "{[":
                return self._malformed(out)
        end = len(buf)
        for i in range(start, len(buf)):
            c = buf[i]
            if self._in_str:
                self._esc, self._in_str = (False, True) if self._esc else (c == "\\", c != '"')
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        if end > start:
            call.arguments += buf[start:end]
            out.calls.append((len(self.calls) - 1, None, None, buf[start:end]))
        self._raw, self.buf = self._raw + buf[:end], buf[end:]
        if self._depth or self._in_str:
            return False
        self.state = self.END
        return True

    def _malformed(self, out: Delta) -> bool:
        """Not a call after all: an unannounced call's text is content; an announced one
        stays incomplete. The rest is read as text again."""
        if self.state in (self.HEAD, self.NAME, self.SEP):
            out.content += self._raw
        else:
            self.calls[-1].raw = self._raw
        self._name, self._raw, self.state, self.after_call = "", "", self.TEXT, False
        self._depth, self._in_str, self._esc = 0, False, False
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
