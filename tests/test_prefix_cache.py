"""The radix prefix cache inside the real scheduler (the suite's tiny model, fp32): shared prefixes
are reused and reported, outputs equal a run without the cache, eviction under a small
pool, and every way a request ends (finish, abort, retraction) releases its locks."""
from __future__ import annotations

import pytest

from srt.transport.io_struct import AbortReq, FlushCacheReq
from tests.test_scheduler import make_scheduler, req, run_until_done

SYSTEM = ("You are a careful assistant for a library. Answer in one short sentence, cite no "
          "sources, and never invent book titles. ") * 3
QUESTIONS = ["Where are the maps?", "When do you open?", "Can I renew a loan?",
             "Do you have audiobooks?", "Is there a quiet room?", "How many books can I borrow?"]


def _workload(tok, tag, n=6, new_tokens=10):
    return [req(tok, f"{tag}{i}", SYSTEM + q, temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
            for i, q in enumerate(QUESTIONS[:n])]


@pytest.fixture(scope="module")
def cached(tiny_dir, smollm2_tokenizer):
    return make_scheduler(tiny_dir, smollm2_tokenizer, max_total_tokens=4096, max_running_requests=8)


@pytest.fixture(scope="module")
def uncached(tiny_dir, smollm2_tokenizer):
    return make_scheduler(tiny_dir, smollm2_tokenizer, max_total_tokens=4096, max_running_requests=8,
                          disable_radix_cache=True)


def test_shared_prefix_is_reused_reported_and_outputs_unchanged(cached, uncached, smollm2_tokenizer):
    tok = smollm2_tokenizer
    want = run_until_done(uncached, {0: _workload(tok, "u")})
    first = run_until_done(cached, {0: _workload(tok, "a", n=1)})  # warms the cache
    got = run_until_done(cached, {0: _workload(tok, "b")})
    prefix = len(tok(SYSTEM)["input_ids"])
    for i in range(6):
        assert got[f"b{i}"]["ids"] == want[f"u{i}"]["ids"]
    assert first["a0"]["ids"] == want["u0"]["ids"] and first["a0"]["cached_tokens"] == 0
    assert cached.reqs == {} and cached.kv.tree.protected_size == 0
    # Every later request reused at least the system prompt (the tokenizer may merge its
    # last token with the question's first, hence the -1).
    cached_counts = [got[f"b{i}"]["cached_tokens"] for i in range(6)]
    assert all(c >= prefix - 1 for c in cached_counts), cached_counts
    assert cached_counts[0] == len(tok(SYSTEM + QUESTIONS[0])["input_ids"]) - 1  # all but the last


def test_eviction_under_a_small_pool_keeps_outputs_and_accounting(tiny_dir, smollm2_tokenizer, uncached):
    tok = smollm2_tokenizer
    small = make_scheduler(tiny_dir, tok, max_total_tokens=400, max_running_requests=4)
    want = run_until_done(uncached, {0: _workload(tok, "u", new_tokens=20)})
    # Distinct prompts one after another fill the pool with cached prefixes; later ones
    # need the space, so the tree must evict (least recently used first).
    got = {}
    for i, r in enumerate(_workload(tok, "s", new_tokens=20)):
        got.update(run_until_done(small, {0: [r]}))
        small.kv.check_idle_integrity()  # free + cached == total after each
    assert [got[f"s{i}"]["ids"] for i in range(6)] == [want[f"u{i}"]["ids"] for i in range(6)]
    tree = small.kv.tree
    assert tree.total_size() <= 400 and tree.protected_size == 0
    assert small.kv.allocator.available_size() + tree.total_size() == 400


def test_abort_and_retraction_release_their_locks(tiny_dir, smollm2_tokenizer, monkeypatch):
    tok = smollm2_tokenizer
    monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "1")  # admit optimistically
    s = make_scheduler(tiny_dir, tok, max_total_tokens=360, max_running_requests=6)
    run_until_done(s, {0: _workload(tok, "warm", n=1)})
    arrivals = {0: _workload(tok, "r", new_tokens=60), 3: [AbortReq("r1")]}
    outs = run_until_done(s, arrivals)  # 6 x (~70 + 60) tokens cannot fit: retractions
    assert s.num_retractions > 0
    assert outs["r1"]["finish"].type == "abort"
    assert all(outs[f"r{i}"]["finish"].type == "length" for i in (0, 2, 3, 4, 5))
    assert s.kv.tree.protected_size == 0  # check_idle_integrity in run_until_done too


def test_flush_cache_only_when_idle(cached, smollm2_tokenizer):
    tok = smollm2_tokenizer
    run_until_done(cached, {0: _workload(tok, "f", n=2)})
    assert cached.kv.tree.total_size() > 0
    cached.process_input_requests(_workload(tok, "busy", n=1))
    refused = cached.flush_cache("x")
    assert not refused.success and "running or waiting" in refused.message
    run_until_done(cached)
    cached.process_input_requests([FlushCacheReq("y")])
    (reply,) = cached.step()
    assert reply.rid == "y" and reply.success
    assert cached.kv.tree.total_size() == 0
    assert cached.kv.allocator.available_size() == cached.kv.allocator.size
