"""Offline Engine: real scheduler subprocess, the suite's tiny model, context-manager shutdown."""
from __future__ import annotations

import os

import pytest

from srt import Engine


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with Engine(model_path=tiny_dir, max_total_tokens=2048, max_running_requests=8, dtype="float32",
                random_seed=0) as eng:
        yield eng
    assert not any(p.is_alive() for p in eng._handles.procs), "scheduler outlived the Engine"
    assert not os.path.exists(eng.port_args.local_dir), "the Engine left its IPC folder behind"


def test_ipc_folder_is_private_while_serving(engine):
    # Removed at shutdown (the fixture checks); here it holds the sockets, mode 0700.
    folder = engine.port_args.local_dir
    assert os.path.isdir(folder) and os.stat(folder).st_mode & 0o777 == 0o700


def test_single_and_batch(engine, smollm2_tokenizer):
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    one = engine.generate("The capital of France is", params)
    assert set(one) >= {"text", "meta_info"}
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(smollm2_tokenizer("The capital of France is")["input_ids"])
    assert meta["completion_tokens"] == 8
    assert meta["finish_reason"]["type"] == "length"
    assert one["text"] == smollm2_tokenizer.decode(one["output_ids"], skip_special_tokens=True)
    many = engine.generate(["Hello,", "The capital of France is", "1, 2, 3,"], params)
    assert len(many) == 3
    assert many[1]["text"] == one["text"]  # greedy: same alone and batched
    assert all(m["meta_info"]["completion_tokens"] == 8 for m in many)


def test_token_id_prompt_and_per_prompt_params(engine, smollm2_tokenizer):
    ids = smollm2_tokenizer("Once upon a time")["input_ids"]
    outs = engine.generate([ids, "Once upon a time"],
                           [{"temperature": 0, "max_new_tokens": 3},
                            {"temperature": 0, "max_new_tokens": 5}])
    assert outs[0]["meta_info"]["completion_tokens"] == 3
    assert outs[1]["meta_info"]["completion_tokens"] <= 5
    assert outs[1]["output_ids"][:3] == outs[0]["output_ids"]


def test_bad_params_raise_and_engine_keeps_working(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("hi", {"top_p": 1.5})
    out = engine.generate("hi", {"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] <= 2


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="no_such_flag"):
        Engine(no_such_flag=1)
