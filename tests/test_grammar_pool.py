"""The node's grammar compile pool (srt/grammar_pool) with real worker processes, real
xgrammar / llguidance / outlines compiles and SmolLM2's tokenizer: exported grammars load
back into matchers that accept what the local compile accepts, a TP group's ranks share one
compile, and a compile past its timeout (or no longer wanted) is killed at once."""
from __future__ import annotations

import json
import os
import uuid

import psutil
import pytest
from process_helpers import wait_for

from constrained.base_grammar_backend import InvalidGrammarObject
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend
from constrained.outlines_backend import OutlinesGrammarBackend
from constrained.registry import create_grammar_backend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from srt.grammar_pool.client import CompilePoolClient
from srt.grammar_pool.private_dir import new_pool_dir, pool_socket_address
from srt.grammar_pool.service import STOP_SIGNAL, PoolConfig, start_pool_service
from srt.server_args import ServerArgs

VOCAB, EOS = 49152, (2,)
PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})
# 300 strings of distinct fixed lengths (^[a-z]{n}$): ~9 s for xgrammar 0.2.9 on these
# machines, the kind of compile that used to keep a core busy after its request left.
# (0.2.9 compiles the old six 32,000-character maxLengths in milliseconds.)
SLOW = json.dumps({"type": "object", "required": [f"p{i}" for i in range(300)],
                   "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i + 1}}}$"}
                                  for i in range(300)}})


def accepts(grammar, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    try:
        for t in ids + [EOS[0]]:
            grammar.accept_token(t)
    except ValueError:
        return False
    return grammar.is_terminated()


@pytest.mark.parametrize("make", [XGrammarGrammarBackend, GuidanceBackend, OutlinesGrammarBackend])
def test_exported_grammar_loads_back_and_constrains_alike(make, smollm2_tokenizer):
    backend = make.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, EOS, JsonOptions()))
    for key, good, bad in [(("json_schema", PERSON), '{"name": "Ann", "age": 7}', '{"name": 7}'),
                           (("regex", r"[0-9]{3}-x"), "123-x", "12-x"),
                           (("choice", json.dumps(["yes", "no"])), "no", "maybe")]:
        local = backend.init_value(key)
        fmt, data = local.export()
        loaded = backend.load_exported(fmt, data)
        assert type(loaded) is type(local)
        for text, ok in ((good, True), (bad, False)):
            assert accepts(local.copy(), smollm2_tokenizer, text) is ok
            assert accepts(loaded.copy(), smollm2_tokenizer, text) is ok, (make.name, key, text)
    failed = backend.init_value(("regex", "(unclosed"))
    assert isinstance(backend.load_exported(*failed.export()), InvalidGrammarObject)
    assert backend.load_exported(*failed.export()).message == failed.message


@pytest.fixture(scope="module")
def pool(tiny_dir, smollm2_tokenizer):
    """A real pool service (2 workers, 3 s timeout) and the rank-side backend it serves."""
    args = ServerArgs(model_path=tiny_dir, grammar_backend="xgrammar", log_level="warning")
    directory = new_pool_dir()
    address = pool_socket_address(directory)
    service = start_pool_service(PoolConfig(args, VOCAB, EOS, 0, directory, address, 2, 3.0))
    backend = create_grammar_backend(args, smollm2_tokenizer, VOCAB, EOS)
    try:
        yield service, address, backend
    finally:
        service.send_signal(STOP_SIGNAL)  # as the rank's death does (parent-death signal)
        service.wait(10)
    assert not os.path.exists(directory)  # it removed its socket directory


def workers(service) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(service.pid).children():  # also multiprocessing's resource tracker
        try:
            if "grammar_compile" in p.name() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def idle_workers(service) -> None:
    """Every worker started and waiting for tasks (a fresh one spends seconds starting)."""
    wait_for(lambda: workers(service) and all(p.cpu_percent(0.3) < 5 for p in workers(service)),
             90, "idle workers")


def busy_worker(service) -> psutil.Process:
    """The worker that is compiling: its process title says so."""
    def find():
        for p in workers(service):
            try:
                if "(compiling" in " ".join(p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        return None
    return wait_for(find, 60, "a worker to start compiling")


def test_ranks_share_one_compile_and_results_load(pool, smollm2_tokenizer):
    service, address, backend = pool
    rank0, rank1 = CompilePoolClient(address, "[r0]"), CompilePoolClient(address, "[r1]")
    rank2 = CompilePoolClient(address, "[r2]")
    try:
        key = ("json_schema", PERSON.replace("age", f"age_{uuid.uuid4().hex[:6]}"))
        f0, f1 = rank0.submit(key, backend), rank1.submit(key, backend)
        g0, g1 = f0.result(120), f1.result(120)
        # One compile for both: the same timing figures travelled to both ranks.
        assert g0.stats.compile_time == g1.stats.compile_time > 0
        assert g0.stats.dispatch_type == "xgrammar"
        name = json.loads(key[1])["required"][1]
        assert accepts(g0, smollm2_tokenizer, f'{{"name": "A", "{name}": 3}}')
        assert not accepts(g1, smollm2_tokenizer, '{"name": "A"}')
        late = rank2.submit(key, backend).result(30)  # from the pool's cache
        assert late.stats.compile_time == g0.stats.compile_time
        bad = rank0.submit(("regex", "(unclosed"), backend).result(60)
        assert isinstance(bad, InvalidGrammarObject) and "regex" in bad.message
    finally:
        rank0.close()
        rank1.close()
        rank2.close()


def test_closed_client_leaves_nothing_for_the_garbage_collector(smollm2_tokenizer):
    """close() closes every socket and terminates the context itself: a context the garbage
    collector finds in a reference cycle with sockets still open blocks forever in term()
    (a failed test's traceback made one, and hung the whole suite). A submit after close
    is answered at once, never with a future nobody resolves."""
    directory = new_pool_dir()  # private, but nothing binds it: no service is needed here
    try:
        client = CompilePoolClient(pool_socket_address(directory), "[r0]")
        client.release(("regex", "x"))  # unknown key: a no-op
        client.close()
        client.close()  # idempotent
        assert client._zmq.closed
        assert all(s.closed for s in (client._sock, client._wake_in, client._wake_out))
        after = client.submit(("regex", "[a-z]+"), None).result(0)
        assert isinstance(after, InvalidGrammarObject) and "client is closed" in after.message
    finally:
        os.rmdir(directory)


def test_compile_past_its_timeout_is_killed_within_a_second(pool):
    service, address, backend = pool
    client = CompilePoolClient(address, "[r0]")
    try:
        idle_workers(service)
        future = client.submit(("json_schema", SLOW.replace("p0", f"t{uuid.uuid4().hex[:6]}")), backend)
        worker = busy_worker(service)
        value = future.result(60)
        assert isinstance(value, InvalidGrammarObject)
        assert "timed out" in value.message and "GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT" in value.message
        assert 3.0 <= value.stats.compile_time < 4.5
        wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 1.0,
                 "the timed-out worker to be gone")
        wait_for(lambda: workers(service), 30, "a replacement worker")
    finally:
        client.close()


def test_released_compile_is_killed_within_a_second(pool):
    service, address, backend = pool
    client = CompilePoolClient(address, "[r0]")
    try:
        idle_workers(service)
        key = ("json_schema", SLOW.replace("p0", f"r{uuid.uuid4().hex[:6]}"))
        future = client.submit(key, backend)
        worker = busy_worker(service)
        client.release(key)  # its only request went away (abort, disconnect)
        # Killed once it has run RELEASE_GRACE_S (1 s): within a second of the release.
        wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 1.2,
                 "the abandoned compile's worker to be gone")
        assert not future.done()  # nobody waits for it: it is dropped, never resolved
        ok = client.submit(("regex", "[a-z]+"), backend).result(60)  # the pool serves on
        assert not isinstance(ok, InvalidGrammarObject)
    finally:
        client.close()


def test_crashed_worker_fails_only_its_grammar(pool):
    service, address, backend = pool
    client = CompilePoolClient(address, "[r0]")
    try:
        idle_workers(service)
        future = client.submit(("json_schema", SLOW.replace("p0", f"c{uuid.uuid4().hex[:6]}")), backend)
        busy_worker(service).kill()  # as the kernel's OOM killer would
        value = future.result(30)
        assert isinstance(value, InvalidGrammarObject)
        assert "the compiler process died while compiling it (exit code -9)" in value.message
        ok = client.submit(("regex", "[0-9]+x"), backend).result(60)  # a fresh worker serves on
        assert not isinstance(ok, InvalidGrammarObject)
    finally:
        client.close()


def test_grammar_too_large_to_ship_is_rebuilt_on_the_rank(monkeypatch, smollm2_tokenizer):
    """xgrammar's JSON export grows much faster than the grammar (a 42 MB grammar needs more
    than 8 GB): past MAX_EXPORT_BYTES a worker answers "rebuild" and the rank compiles it."""
    import constrained.xgrammar_backend as xgb
    from srt.grammar_pool.messages import CompileResult

    backend = XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, EOS, JsonOptions()))
    key = ("json_schema", PERSON)
    assert backend.init_value(key).export()[0] == "xgrammar"
    monkeypatch.setattr(xgb, "MAX_EXPORT_BYTES", 0)
    assert backend.init_value(key).export() == ("rebuild", b"")
    directory = new_pool_dir()  # a client connects only in a private directory
    client = CompilePoolClient(pool_socket_address(directory), "[r0]")  # only its loading is used
    try:
        header = CompileResult(key[0], key[1], "rebuild", 1.5, 1.4, "xgrammar")
        grammar = client._load(backend, header, None)
        assert grammar.stats.compile_time == 1.5 and grammar.stats.dispatch_type == "xgrammar"
        assert accepts(grammar, smollm2_tokenizer, '{"name": "Ann", "age": 7}')
    finally:
        client.close()
        os.rmdir(directory)
