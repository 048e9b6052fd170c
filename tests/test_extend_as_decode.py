"""extend_as_decode (srt/model_executor/extend_as_decode.py): which prefills run as decode
rows and the rows they become. The served path (the compiled graphs' tokens against the
eager prefill's): test_compiled_decode.py."""
from __future__ import annotations

import torch

from srt.model_executor.extend_as_decode import extend_as_decode
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode


def _extend(prefix_lens: list[int], new_lens: list[int], **kw) -> ForwardBatch:
    positions = [p for s, n in zip(prefix_lens, new_lens) for p in range(s, s + n)]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    seq_lens = [s + n for s, n in zip(prefix_lens, new_lens)]
    return ForwardBatch(ForwardMode.EXTEND, t([7] * len(positions)), t(positions), t(range(100, 100 + len(positions))),
                        t([3, 5, 9][:len(new_lens)]), t(seq_lens), seq_lens, list(new_lens), list(prefix_lens),
                        None, None, **kw)


def test_one_token_each_is_already_a_decode_batch():
    fb = _extend([10, 4], [1, 1])
    decode, last = extend_as_decode(fb, max_rows=16)
    assert decode.mode is ForwardMode.DECODE and last is None
    assert decode.input_ids is fb.input_ids and decode.seq_lens is fb.seq_lens  # the scheduler's own tensors
    assert decode.extend_prefix_lens_cpu == [10, 4] and decode.seq_lens_cpu == [11, 5]


def test_several_tokens_become_one_row_each_on_their_sequence():
    fb = _extend([10, 4, 0], [3, 1, 2])
    decode, last = extend_as_decode(fb, max_rows=6)
    assert decode.mode is ForwardMode.DECODE
    assert decode.req_pool_indices.tolist() == [3, 3, 3, 5, 9, 9]
    assert decode.positions.tolist() == [10, 11, 12, 4, 0, 1]
    assert decode.extend_prefix_lens_cpu == [10, 11, 12, 4, 0, 1]
    assert decode.seq_lens.tolist() == decode.seq_lens_cpu == [11, 12, 13, 5, 1, 2]
    assert decode.extend_seq_lens_cpu == [1] * 6 and decode.batch_size == 6
    assert last.tolist() == [2, 3, 5]  # each sequence's last row: its logits are returned
    assert decode.out_cache_loc is fb.out_cache_loc and decode.input_ids is fb.input_ids
    assert not any(t.is_inference() for t in (decode.req_pool_indices, decode.seq_lens))


def test_batches_that_must_prefill_stay_prefills():
    assert extend_as_decode(_extend([10, 4], [3, 2]), max_rows=4) is None  # more tokens than graph rows
    assert extend_as_decode(_extend([10], [3], logit_rows=[0, 1, 2]), max_rows=16) is None  # prompt logprobs
    assert extend_as_decode(_extend([10], [3], return_all_logits=True), max_rows=16) is None
    assert extend_as_decode(_extend([10], [3], state_marks=[((1, 2),)]), max_rows=16) is None  # hybrid states
    decode_fb = _extend([10], [1])
    decode_fb.mode = ForwardMode.DECODE
    assert extend_as_decode(decode_fb, max_rows=16) is None
