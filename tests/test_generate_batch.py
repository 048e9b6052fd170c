"""Batched /generate bodies split per prompt, and SGLang's no-op fields (no model, no server:
the served behaviour is tests/test_sglang_compat.py)."""
import pytest

from srt.frontend.generate_batch import MAX_BATCH, split_batch
from srt.frontend.generate_input import GenerateReqInput


def test_one_prompt_is_not_a_batch():
    assert split_batch({"text": "a"}) is None
    assert split_batch({"input_ids": [1, 2, 3]}) is None


def test_per_prompt_lists_and_shared_values():
    items = split_batch({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"max_new_tokens": 1}],
                         "return_logprob": True, "top_logprobs_num": [1, 0], "rid": "r", "stream": True})
    assert items == [
        {"text": "a", "sampling_params": {"n": 2}, "return_logprob": True, "top_logprobs_num": 1, "rid": "r_0",
         "stream": True},
        {"text": "b", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "top_logprobs_num": 0,
         "rid": "r_1", "stream": True}]
    ids = split_batch({"input_ids": [[1], [2, 3]], "rid": ["x", "y"]})
    assert [(i["input_ids"], i["rid"]) for i in ids] == [([1], "x"), ([2, 3], "y")]
    assert all(GenerateReqInput.from_dict(i).input_ids for i in ids)


@pytest.mark.parametrize("body, message", [
    ({"text": []}, "text is an empty list"),
    ({"text": ["a"] * (MAX_BATCH + 1)}, f"at most {MAX_BATCH}"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid is a list of 1 values for a batch of 2"),
    ({"input_ids": [[1], [2]], "top_logprobs_num": [1, 2, 3]}, "top_logprobs_num is a list of 3"),
    ({"text": ["a"], "input_ids": [[1]]}, "Exactly one of text or input_ids")])
def test_bad_batches(body, message):
    with pytest.raises(ValueError, match=message):
        split_batch(body)


def test_sglang_defaults_are_dropped_and_features_refused():
    obj = GenerateReqInput.from_dict({
        "text": "a", "lora_path": None, "image_data": [None, None], "return_hidden_states": False,
        "log_metrics": False, "conversation_id": "c",
        "sampling_params": {"spaces_between_special_tokens": True, "no_stop_trim": False, "stop_regex": None,
                            "sampling_seed": 4}})
    assert obj.sampling_params == {"seed": 4}
    for body, message in (({"text": "a", "lora_path": "l"}, "lora_path is not supported"),
                          ({"text": "a", "log_metrics": "yes"}, "log_metrics is not supported .* boolean"),
                          ({"text": "a", "sampling_params": {"no_stop_trim": True}},
                           "sampling_params.no_stop_trim is not supported"),
                          ({"text": "a", "sampling_params": {"sampling_seed": 1, "seed": 2}}, "differ")):
        with pytest.raises(ValueError, match=message):
            GenerateReqInput.from_dict(body)
