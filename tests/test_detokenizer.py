"""Incremental detokenization and stop-string trimming (frontend, no model)."""
import pytest

from srt.frontend.detokenizer import DecodeState, trim_stop

pytestmark = pytest.mark.timeout(120)

TEXT = "Hello, wörld! 日本語 🎉 emoji and more text."


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def test_streamed_text_is_stable_and_never_half_a_character(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt = tok.encode("Say something:", add_special_tokens=False)
    st = DecodeState(tok, prompt)
    seen = []
    for t in ids:
        st.add_tokens([t])
        seen.append(st.decoded_text)
        assert "\ufffd" not in st.decoded_text
    for a, b in zip(seen, seen[1:]):
        assert b.startswith(a)  # append-only
    assert seen[-1] == TEXT
    # One-shot (non-stream) decoding gives the same text.
    st2 = DecodeState(tok, prompt)
    st2.add_tokens(ids, flush=True)
    assert st2.decoded_text == TEXT


def test_flush_emits_an_incomplete_character_at_finish(tok):
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    st = DecodeState(tok, [])
    st.add_tokens(ids[:1])
    assert st.decoded_text == ""
    st.add_tokens([], flush=True)
    assert st.decoded_text == "\ufffd"


def test_skip_special_tokens(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    a = DecodeState(tok, [], skip_special_tokens=True)
    a.add_tokens(ids, flush=True)
    b = DecodeState(tok, [], skip_special_tokens=False)
    b.add_tokens(ids, flush=True)
    assert a.decoded_text == "hi" and b.decoded_text == "hi" + tok.eos_token


@pytest.mark.parametrize(
    "text,stop,finished,expected",
    [
        ("Hello world. Bye", ["."], True, "Hello world"),
        ("Hello world. Bye. x", [". B", "."], True, "Hello world"),
        ("Hello wor", ["world"], False, "Hello "),  # "wor" may become "world": hold back
        ("Hello wor", ["world"], True, "Hello wor"),  # finished for another reason: flush
        ("Hello", ["xyz"], False, "Hello"),
        ("a\n", ["\n\n"], False, "a"),
        ("", ["x"], False, ""),
    ],
)
def test_trim_stop(text, stop, finished, expected):
    assert trim_stop(text, stop, finished) == expected


def test_streamed_visible_text_is_a_prefix_of_the_final_text(tok):
    ids = tok.encode("one two three four five", add_special_tokens=False)
    st = DecodeState(tok, [], stop=["four"])
    outs = []
    for t in ids:
        st.add_tokens([t])
        outs.append(st.visible_text(False))
    final = st.visible_text(True, "four")
    assert final == "one two three "
    assert all(final.startswith(o) for o in outs)
