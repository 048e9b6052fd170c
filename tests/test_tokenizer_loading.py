"""``get_tokenizer``: a directory whose tokenizer_config.json names a generic class loads
that class directly, skipping AutoTokenizer's scan of every transformers model module (a
cost every process of a server paid at start); the result is the tokenizer AutoTokenizer
builds. Other directories still go through AutoTokenizer."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from srt.tokenizer_utils import _generic_class, apply_chat_template, get_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and ünïcödé ✓", "<|im_start|>user\nhi<|im_end|>", "12345 67.8e-9"]


def test_embedded_tokenizer_equals_autotokenizers(smollm2_dir):
    from transformers import AutoTokenizer

    ours, auto = get_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)
    assert _generic_class(smollm2_dir) == "TokenizersBackend"
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                         auto.pad_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == auto.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    assert apply_chat_template(ours, messages) == apply_chat_template(auto, messages)


def test_loads_without_scanning_transformers_models(smollm2_dir):
    code = ("import sys; from srt.tokenizer_utils import get_tokenizer; get_tokenizer(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))")
    out = subprocess.run([sys.executable, "-c", code, smollm2_dir], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_model_specific_class_goes_through_autotokenizer(smollm2_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{smollm2_dir}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert _generic_class(str(tmp_path)) is None
    from transformers import AutoTokenizer

    assert type(get_tokenizer(str(tmp_path))) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert _generic_class(str(tmp_path)) is None  # AutoTokenizer then reports the broken file
