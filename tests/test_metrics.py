"""--enable-metrics without a model: the entry rank's throttled reporter, the wire message,
the frontend's collectors in a real CollectorRegistry read back with Prometheus' text
parser, and GET /metrics (404 without the flag, no API key needed with it, as SGLang)."""
from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from constrained.grammar_metrics import GrammarMetrics
from srt.entrypoints.http_server import create_app
from srt.transport.io_struct import FRONTEND_INPUT_CODEC, FinishReason
from srt.metrics.frontend import FrontendMetrics, create_frontend_metrics
from srt.metrics.scheduler_reporter import SchedulerMetricsReporter
from srt.server_args import ServerArgs


def samples(text: str) -> dict:
    """{(sample name, sorted label items): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lb), v in parsed.items() if n == name and set(labels.items()) <= set(lb))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fake_scheduler(metrics: GrammarMetrics, running=(), waiting=(), grammar_queue=(), available=900):
    kv = SimpleNamespace(allocator=SimpleNamespace(size=1000), available_tokens=lambda: available)
    return SimpleNamespace(kv=kv, running=list(running), waiting=list(waiting), num_retractions=2,
                           grammar_manager=SimpleNamespace(grammar_queue=list(grammar_queue), metrics=metrics))


def req(prompt: int, cached: int, outputs: int = 0, scheduled=None):
    return SimpleNamespace(origin_input_ids=[1] * prompt, cached_tokens=cached, output_ids=[7] * outputs,
                           first_scheduled_time=scheduled)


def test_reporter_is_throttled_sends_on_change_and_fits_the_wire():
    clock, sent, gm = Clock(), [], GrammarMetrics()
    rep = SchedulerMetricsReporter(dp_rank=1, interval=1.0, clock=clock)
    a, b = req(10, 4), req(30, 0)
    sched = fake_scheduler(gm, running=[a, b], waiting=[req(5, 0)], grammar_queue=[req(5, 0)], available=900)
    rep.before_batch(True, [a, b])  # first admissions: 4 of 40 prompt tokens cached
    a.output_ids.append(1)
    b.output_ids.append(2)
    rep.after_batch([a, b])
    rep.before_batch(False, [a, b])  # a decode step with a fast-forward: 3 + 1 tokens
    a.output_ids += [3, 4, 5]
    b.output_ids.append(6)
    rep.after_batch([a, b])
    clock.t += 0.5
    rep.maybe_send(sched, sent.append)
    assert sent == []  # not before the interval
    clock.t += 1.5
    gm.observe_compile("xgrammar", "regex", 0.02, failed=False)
    rep.maybe_send(sched, sent.append)
    (m,) = sent
    assert (m.dp_rank, m.num_running_reqs, m.num_queue_reqs, m.num_grammar_queue_reqs) == (1, 2, 2, 1)
    assert (m.num_used_tokens, m.max_total_num_tokens, m.token_usage) == (100, 1000, 0.1)
    assert m.gen_throughput == 6 / 2.0 and m.cache_hit_rate == 0.1 and m.num_retracted_reqs == 2
    assert m.spec_accept_length == 4 / 2  # decode steps only: 3 + 1 tokens over 2 requests
    assert m.grammar.compile_seconds[0].labels == ("xgrammar", "regex")
    assert FRONTEND_INPUT_CODEC.decode(FRONTEND_INPUT_CODEC.encode(m)) == m
    clock.t += 1.0  # idle now: throughput drops to 0 once, then nothing changes
    rep.maybe_send(sched, sent.append)
    assert len(sent) == 2 and sent[1].gen_throughput == 0 and sent[1].cache_hit_rate == 0.1
    assert sent[1].spec_accept_length == 2.0  # kept while nothing decodes
    clock.t += 1.0
    rep.maybe_send(sched, sent.append)
    assert len(sent) == 2


def test_reporter_exists_only_on_entry_ranks_with_the_flag():
    entry, other = SimpleNamespace(is_entry_rank=True, dp_rank=0), SimpleNamespace(is_entry_rank=False, dp_rank=0)
    assert SchedulerMetricsReporter.create(ServerArgs(), entry) is None
    assert SchedulerMetricsReporter.create(ServerArgs(enable_metrics=True), other) is None
    assert SchedulerMetricsReporter.create(ServerArgs(enable_metrics=True), entry) is not None
    assert create_frontend_metrics(ServerArgs()) is None


def _scheduler_message(dp_rank: int, running: int):
    gm = GrammarMetrics()
    gm.observe_compile("llguidance (fallback: uses oneOf)", "json_schema", 0.003, failed=False)
    gm.observe_compile("xgrammar", "regex", 0.5, failed=True)
    gm.count_fallback("uses_oneOf", "llguidance")
    gm.count("cache_hits", 3)
    gm.count("cache_misses", 2)
    gm.observe_agreement(0.0007)
    rep = SchedulerMetricsReporter(dp_rank, clock=lambda: 0.0)
    return rep.build(fake_scheduler(gm, running=[req(1, 0)] * running), 1.0)


def test_frontend_exposes_every_dp_group_and_request_metrics():
    fm = FrontendMetrics("smollm2")
    fm.on_scheduler_metrics(_scheduler_message(0, running=2))
    fm.on_scheduler_metrics(_scheduler_message(1, running=5))
    stream = fm.start_request(SimpleNamespace(stream=True, sampling_params=SimpleNamespace(constraint=None)))
    stream.on_output(None, 12, 1, 0)
    stream.on_output(None, 12, 3, 0)  # two more tokens: two inter-token observations
    stream.on_output(FinishReason("length", matched=4), 12, 4, 8)
    plain = fm.start_request(SimpleNamespace(stream=False, sampling_params=SimpleNamespace(constraint=("regex", "a"))))
    plain.on_output(FinishReason("abort", message="x"), 5, 0, 0)
    gone = fm.start_request(SimpleNamespace(stream=True, sampling_params=SimpleNamespace(constraint=None)))
    gone.on_client_abort()
    p = samples(fm.render().decode())
    model = {"model_name": "smollm2"}
    assert value(p, "sglang:num_running_reqs", dp_rank="0") == 2
    assert value(p, "sglang:num_running_reqs", dp_rank="1", **model) == 5
    assert ("sglang:spec_accept_length", (("dp_rank", "0"), ("model_name", "smollm2"))) in p
    assert value(p, "sglang:num_grammar_cache_hit_total") == 6 and value(p, "sglang:num_grammar_total") == 10
    assert value(p, "sglang:grammar_compilation_time_seconds_count", backend="llguidance", kind="json_schema") == 2
    assert value(p, "sglang:grammar_compilation_time_seconds_bucket", backend="xgrammar", le="0.2") == 0
    assert value(p, "sglang:grammar_compilation_time_seconds_bucket", backend="xgrammar", le="0.5") == 2
    assert value(p, "sglang:num_grammar_compile_failed_total", backend="xgrammar", kind="regex") == 2
    assert value(p, "sglang:num_grammar_auto_fallback_total", reason="uses_oneOf", outcome="llguidance") == 2
    assert value(p, "sglang:grammar_agreement_time_seconds_count", dp_rank="1") == 1
    assert value(p, "sglang:prompt_tokens_total", **model) == 17
    assert value(p, "sglang:generation_tokens_total") == 4 and value(p, "sglang:cached_tokens_total") == 8
    assert value(p, "sglang:num_requests_total") == 2 and value(p, "sglang:num_so_requests_total") == 1
    assert value(p, "sglang:num_aborted_requests_total") == 2
    assert value(p, "sglang:time_to_first_token_seconds_count") == 1  # streaming requests only
    assert value(p, "sglang:inter_token_latency_seconds_count") == 3
    assert value(p, "sglang:e2e_request_latency_seconds_count") == 2


def _client(metrics, api_key=None) -> TestClient:
    tm = SimpleNamespace(metrics=metrics, start_handle_loop=lambda: None, tokenizer=None, context_len=2048)
    return TestClient(create_app(tm, ServerArgs(api_key=api_key, enable_metrics=metrics is not None)))


def test_metrics_endpoint_only_with_the_flag_and_open_like_health():
    assert _client(None).get("/metrics").status_code == 404
    fm = FrontendMetrics("m")
    fm.on_scheduler_metrics(_scheduler_message(0, running=1))
    c = _client(fm, api_key="secret")
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    assert value(samples(r.text), "sglang:num_running_reqs") == 1
    assert c.get("/v1/models").status_code == 401  # the key still guards everything else
