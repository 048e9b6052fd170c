"""The ZMQ wire format and transport security (CPU only, no model, a few seconds).

- srt/transport/wire.py: typed msgpack codecs round-trip every message and reject anything
  else (pickles, whose __reduce__ never runs; garbage; wrong types; truncations);
- srt/transport/zmq_transport.py: CURVE over real TCP on 127.0.0.1 (only holders of the
  cluster secret get messages through; refusals are counted), ipc:// in private dirs only;
- srt/security/cluster_secret.py, constrained/schema_refs.py, srt/security/http_guard.py.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import stat
import threading
import time

import msgspec
import pytest
import zmq

from constrained.schema_refs import ExternalRefError, check_no_external_refs
from sampling.sampling_params import SamplingParams
from srt import environ
from srt.transport import wire
from srt.transport.io_struct import (
    FRONTEND_INPUT_CODEC,
    READY_CODEC,
    SCHEDULER_INPUT_CODEC,
    AbortReq,
    BatchTokenOut,
    FinishReason,
    PortArgs,
    RankReady,
    SchedulerInfo,
    TokenizedGenerateReq,
)
from srt.transport.wire import DropCounter, MessageCodec, WireError, recv_message
from srt.transport.zmq_transport import ZmqTransport, check_private_dir
from srt.security.cluster_secret import (
    MIN_SECRET_CHARS,
    ClusterSecretError,
    CurveKeys,
    load_cluster_secret,
    require_secret,
)
from srt.security.http_guard import HttpGuardConfig

SECRET = "0123456789abcdef" * 4  # 64 characters
OTHER_SECRET = "fedcba9876543210" * 4
REFUSAL_WAIT_S = 10.0  # bounded waits: generous, but a passing test returns in ~1 s


# ---- messages ---------------------------------------------------------------------------------
def _params() -> SamplingParams:
    return SamplingParams.from_dict({
        "max_new_tokens": 64, "temperature": 0.5, "top_p": 0.9, "seed": 7,
        "stop": ["</a>", "\n\n"], "stop_token_ids": [2, 3],
        "logit_bias": {"17": -100, 42: 2.5},
        "json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                        "$defs": {"x": {"enum": ["p", "q"]}}},
        "custom_logit_processor": '{"callable": "pkg.mod:Proc"}',
        "custom_params": {"alpha": 0.5, "ids": [1, 2, 3], "nested": {"k": None, "s": "v"}},
    })


def _request(rid: str = "a" * 32) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=tuple(range(100, 300)),
                                sampling_params=_params(), stream=True, require_reasoning=True)


def _step() -> BatchTokenOut:
    return BatchTokenOut(
        rids=("0" * 32, "1" * 32, "2" * 32, "3" * 32, "4" * 32),
        new_token_ids=((5,), (), (7, 8, 9), (10,), (11,)),
        finished_reasons=(None, FinishReason("stop", matched=2),
                          FinishReason("stop", matched="\n\n"), FinishReason("length", matched=64),
                          FinishReason("abort", message="Request aborted by the client.",
                                       status_code=499)),
        prompt_tokens=(10, 20, 30, 40, 50),
        completion_tokens=(1, 2, 3, 64, 5),
    )


def _ready() -> RankReady:
    return RankReady(world_rank=0, name="DP0_TP0",
                     info=SchedulerInfo(max_total_num_tokens=4096, max_running_requests=64,
                                        context_len=8192, vocab_size=49152,
                                        eos_token_ids=(0, 2)),
                     input_addr="tcp://10.0.0.1:5555")


ROUND_TRIPS = [
    (SCHEDULER_INPUT_CODEC, _request()),
    (SCHEDULER_INPUT_CODEC, TokenizedGenerateReq("r", (1,), SamplingParams())),
    (SCHEDULER_INPUT_CODEC, AbortReq("b" * 32)),
    (SCHEDULER_INPUT_CODEC, AbortReq("c", message="timed out", status_code=503)),
    (FRONTEND_INPUT_CODEC, _step()),
    (FRONTEND_INPUT_CODEC, BatchTokenOut((), (), (), (), ())),
    (READY_CODEC, _ready()),
    (READY_CODEC, RankReady(world_rank=3, name="DP1_TP1", error="CUDA out of memory")),
]


@pytest.mark.parametrize("codec,msg", ROUND_TRIPS,
                         ids=[f"{type(m).__name__}{i}" for i, (_, m) in enumerate(ROUND_TRIPS)])
def test_round_trip_equals_original(codec, msg):
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    assert msgspec.msgpack.decode(data)[0] == type(msg).__name__  # [type name, fields]
    got = codec.decode(data)
    assert type(got) is type(msg)
    assert got == msg  # dataclass eq: a list where a tuple was would not compare equal


def test_round_trip_keeps_field_types():
    step = FRONTEND_INPUT_CODEC.decode(FRONTEND_INPUT_CODEC.encode(_step()))
    reasons = step.finished_reasons
    assert reasons[0] is None
    assert type(reasons[1]) is FinishReason and type(reasons[1].matched) is int
    assert reasons[1].matched == 2
    assert type(reasons[2].matched) is str and reasons[2].matched == "\n\n"
    assert reasons[4].message == "Request aborted by the client." and reasons[4].status_code == 499
    assert all(type(t) is tuple for t in step.new_token_ids)

    req = SCHEDULER_INPUT_CODEC.decode(SCHEDULER_INPUT_CODEC.encode(_request()))
    sp = req.sampling_params
    assert type(sp) is SamplingParams and type(req.input_ids) is tuple
    assert sp.logit_bias == ((17, -100.0), (42, 2.5)) and type(sp.logit_bias[0][1]) is float
    assert sp.json_schema == _params().json_schema and '"$ref":"#/$defs/x"' in sp.json_schema
    assert sp.custom_params == {"alpha": 0.5, "ids": [1, 2, 3], "nested": {"k": None, "s": "v"}}
    assert sp.stop == ("</a>", "\n\n") and sp.seed == 7

    ready = READY_CODEC.decode(READY_CODEC.encode(_ready()))
    assert type(ready.info) is SchedulerInfo and ready.info.eos_token_ids == (0, 2)


# ---- what decode refuses ---------------------------------------------------------------------
def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write("pwned")


class _Canary:
    """Unpickling this creates a file: proof that pickle.loads ran attacker-chosen code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return _touch, (self.path,)


def test_pickle_of_valid_message_rejected():
    for codec, msg in ROUND_TRIPS:
        with pytest.raises(WireError):
            codec.decode(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        with pytest.raises(WireError):
            codec.decode(pickle.dumps(msg, 2))


def test_pickle_canary_never_runs(tmp_path):
    live = tmp_path / "live"  # the canary is real: pickle.loads does run it
    pickle.loads(pickle.dumps(_Canary(str(live))))
    assert live.read_text() == "pwned"

    target = tmp_path / "pwned"
    payload = pickle.dumps(_Canary(str(target)))
    for codec in (SCHEDULER_INPUT_CODEC, FRONTEND_INPUT_CODEC, READY_CODEC):
        with pytest.raises(WireError):
            codec.decode(payload)
        drops = DropCounter("test")
        assert recv_message(_FakeSocket(payload), codec, drops) is None
        assert drops.count == 1
    assert not target.exists()


class _FakeSocket:
    def __init__(self, data: bytes):
        self.data = data

    def recv(self, flags=0, copy=True):
        return self.data


def test_random_bytes_rejected():
    rng = random.Random(1234)
    for n in (0, 1, 2, 7, 64, 1000):
        for _ in range(20):
            data = bytes(rng.getrandbits(8) for _ in range(n))
            for codec in (SCHEDULER_INPUT_CODEC, FRONTEND_INPUT_CODEC, READY_CODEC):
                with pytest.raises(WireError):
                    codec.decode(data)


@pytest.mark.parametrize("codec,msg", [
    (SCHEDULER_INPUT_CODEC, _step()),
    (SCHEDULER_INPUT_CODEC, _ready()),
    (FRONTEND_INPUT_CODEC, _request()),
    (FRONTEND_INPUT_CODEC, AbortReq("x")),
    (READY_CODEC, _request()),
    (READY_CODEC, _step()),
], ids=["scheduler<-BatchTokenOut", "scheduler<-RankReady", "frontend<-TokenizedGenerateReq",
        "frontend<-AbortReq", "ready<-TokenizedGenerateReq", "ready<-BatchTokenOut"])
def test_valid_message_of_other_type_rejected(codec, msg):
    other = MessageCodec(type(msg))
    data = other.encode(msg)
    assert other.decode(data) == msg  # valid, just not for this socket
    with pytest.raises(WireError, match="unexpected message type"):
        codec.decode(data)


@pytest.mark.parametrize("raw", [
    ["AbortReq", {"rid": 5}],  # str field given an int
    ["AbortReq", {}],  # required field missing
    ["AbortReq", {"rid": "x", "status_code": "499"}],
    ["AbortReq", {"rid": "x", "status_code": True}],  # bool is not an int
    ["AbortReq", ["x"]],
    ["AbortReq"],
    ["AbortReq", {"rid": "x"}, "extra"],
    [5, {"rid": "x"}],
    {"AbortReq": {"rid": "x"}},
    "AbortReq",
    ["os.system", {"rid": "x"}],
    ["SamplingParams", {}],  # a dataclass the codec knows only as a field, not a message
    ["TokenizedGenerateReq", {"rid": "x", "input_ids": [1, 2.5], "sampling_params": {}}],
    ["TokenizedGenerateReq", {"rid": "x", "input_ids": [1], "sampling_params": {"top_k": "5"}}],
    ["TokenizedGenerateReq", {"rid": "x", "input_ids": [1], "sampling_params": None}],
])
def test_wrong_shape_or_field_type_rejected(raw):
    with pytest.raises(WireError):
        SCHEDULER_INPUT_CODEC.decode(msgspec.msgpack.encode(raw))


def test_hand_built_valid_message_accepted():
    """The hand-built negatives above fail for their defect, not the encoding."""
    got = SCHEDULER_INPUT_CODEC.decode(msgspec.msgpack.encode(["AbortReq", {"rid": "x"}]))
    assert got == AbortReq("x")


def test_truncated_message_rejected():
    for codec, msg in ROUND_TRIPS:
        data = codec.encode(msg)
        cuts = range(len(data)) if len(data) < 400 else list(range(64)) + list(
            range(64, len(data), 37))
        for k in cuts:
            with pytest.raises(WireError):
                codec.decode(data[:k])
        with pytest.raises(WireError):  # trailing bytes
            codec.decode(data + b"\x00")


def test_oversized_message_rejected(monkeypatch):
    data = SCHEDULER_INPUT_CODEC.encode(_request())
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", len(data) - 1)
    with pytest.raises(WireError, match="exceeds"):
        SCHEDULER_INPUT_CODEC.decode(data)


def test_deeply_nested_message_rejected():
    data = b"\x92" + msgspec.msgpack.encode("AbortReq") + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(WireError):
        SCHEDULER_INPUT_CODEC.decode(data)


def test_encode_of_other_type_raises_type_error():
    for codec, msg in [(SCHEDULER_INPUT_CODEC, _step()), (FRONTEND_INPUT_CODEC, _request()),
                       (READY_CODEC, AbortReq("x")), (SCHEDULER_INPUT_CODEC, _params()),
                       (SCHEDULER_INPUT_CODEC, {"rid": "x"}), (FRONTEND_INPUT_CODEC, None)]:
        with pytest.raises(TypeError):
            codec.encode(msg)


def test_drop_counter_counts_and_recv_message_survives():
    drops = DropCounter("test")
    good = SCHEDULER_INPUT_CODEC.encode(AbortReq("x"))
    for data in (b"garbage", pickle.dumps(AbortReq("x")), good[:-1], good):
        recv_message(_FakeSocket(data), SCHEDULER_INPUT_CODEC, drops)
    assert drops.count == 3
    assert recv_message(_FakeSocket(good), SCHEDULER_INPUT_CODEC, drops) == AbortReq("x")
    assert drops.count == 3


# ---- ZmqTransport over TCP with CURVE ------------------------------------------------------------
@pytest.fixture
def transports():
    """ZmqTransports a test makes; all closed at the end (no monitor or ZAP thread leaks)."""
    before = set(threading.enumerate())
    made: list[ZmqTransport] = []

    def make(secret=SECRET, name="test") -> ZmqTransport:
        t = ZmqTransport(CurveKeys.from_secret(secret) if secret else None, name)
        made.append(t)
        return t

    try:
        yield make
    finally:
        for t in made:
            t.close()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        leaked = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        if not leaked:
            break
        time.sleep(0.05)
    assert not leaked, f"threads left running: {leaked}"


def _bind_pull(transport: ZmqTransport) -> tuple[zmq.Socket, str]:
    sock, addr = transport.bind(zmq.PULL, "tcp://127.0.0.1:0")
    assert addr.startswith("tcp://127.0.0.1:") and not addr.endswith(":0")
    return sock, addr


def _wait_refused(transport: ZmqTransport) -> int:
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while transport.refused_handshakes == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return transport.refused_handshakes


def test_tcp_peer_with_the_secret_delivers(transports):
    server, client = transports(), transports()
    pull, addr = _bind_pull(server)
    push = client.connect(zmq.PUSH, addr)
    drops = DropCounter("test")
    for msg in (_request(), AbortReq("z" * 32)):
        push.send(SCHEDULER_INPUT_CODEC.encode(msg))
        assert pull.poll(5000), "the authenticated peer's message did not arrive"
        assert recv_message(pull, SCHEDULER_INPUT_CODEC, drops) == msg
    assert drops.count == 0
    assert server.refused_handshakes == 0


def _plain_push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def _wrong_secret_push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    keys = CurveKeys.from_secret(OTHER_SECRET)
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (
        keys.server_public, keys.client_public, keys.client_secret)
    s.connect(addr)
    return s


def _right_server_key_wrong_client_key_push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """Knows the server's public key but not the client key: only the ZAP check stops it."""
    keys = CurveKeys.from_secret(SECRET)
    public, secret = zmq.curve_keypair()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys.server_public, public, secret
    s.connect(addr)
    return s


@pytest.mark.parametrize("make_peer", [_wrong_secret_push, _plain_push,
                                       _right_server_key_wrong_client_key_push],
                         ids=["other-secret", "plain-no-curve", "zap-wrong-client-key"])
def test_tcp_unauthenticated_peer_delivers_nothing(transports, make_peer):
    server = transports()
    pull, addr = _bind_pull(server)
    ctx = zmq.Context()
    try:
        peer = make_peer(ctx, addr)
        try:
            for _ in range(3):
                try:
                    peer.send(SCHEDULER_INPUT_CODEC.encode(AbortReq("evil")), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            assert pull.poll(1000) == 0, "a peer without the cluster secret got a message through"
            assert _wait_refused(server) > 0, "the refused handshake was not counted"
        finally:
            peer.close(0)
    finally:
        ctx.term()
    with pytest.raises(zmq.Again):
        pull.recv(zmq.NOBLOCK)


def test_tcp_refusals_do_not_block_the_cluster(transports):
    """A refused peer does not stop an authenticated one on the same socket."""
    server, client = transports(), transports()
    pull, addr = _bind_pull(server)
    ctx = zmq.Context()
    try:
        bad = _plain_push(ctx, addr)
        try:
            bad.send(b"x", zmq.NOBLOCK)
            assert _wait_refused(server) > 0
            push = client.connect(zmq.PUSH, addr)
            push.send(SCHEDULER_INPUT_CODEC.encode(AbortReq("ok")))
            assert pull.poll(5000)
            assert recv_message(pull, SCHEDULER_INPUT_CODEC, DropCounter("t")) == AbortReq("ok")
        finally:
            bad.close(0)
    finally:
        ctx.term()


@pytest.mark.parametrize("addr", ["tcp://*:0", "tcp://0.0.0.0:0", "tcp://*:5555",
                                  "tcp://0.0.0.0:5555", "tcp://:0"])
def test_tcp_bind_on_every_interface_refused(transports, addr):
    with pytest.raises(ValueError, match="every interface"):
        transports().bind(zmq.PULL, addr)


def test_tcp_bind_on_every_interface_spelled_otherwise_refused(transports):
    # libzmq binds "tcp://0:0" to 0.0.0.0: it must be refused like "*".
    with pytest.raises(ValueError, match="every interface"):
        transports().bind(zmq.PULL, "tcp://0:0")


def test_tcp_without_keys_refused(transports):
    t = transports(secret=None)
    with pytest.raises(RuntimeError, match="cluster secret"):
        t.bind(zmq.PULL, "tcp://127.0.0.1:0")
    with pytest.raises(RuntimeError, match="cluster secret"):
        t.connect(zmq.PUSH, "tcp://127.0.0.1:5555")


def test_tcp_authenticated_peer_sending_garbage_is_dropped_and_counted(transports):
    server, client = transports(), transports()
    pull, addr = _bind_pull(server)
    push = client.connect(zmq.PUSH, addr)
    drops = DropCounter("test")
    garbage = [b"\x00\xffnot msgpack", pickle.dumps(AbortReq("x")),
               msgspec.msgpack.encode(["AbortReq", {"rid": 5}]),
               FRONTEND_INPUT_CODEC.encode(_step())]
    for data in garbage:
        push.send(data)
        assert pull.poll(5000)
        assert recv_message(pull, SCHEDULER_INPUT_CODEC, drops) is None
    assert drops.count == len(garbage)
    push.send(SCHEDULER_INPUT_CODEC.encode(AbortReq("after")))  # the socket still works
    assert pull.poll(5000)
    assert recv_message(pull, SCHEDULER_INPUT_CODEC, drops) == AbortReq("after")
    assert drops.count == len(garbage)
    assert server.refused_handshakes == 0


# ---- ipc:// --------------------------------------------------------------------------------
def test_ipc_in_shared_dir_refused(tmp_path, transports):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o755)
    t = transports(secret=None)
    with pytest.raises(PermissionError, match="0700"):
        t.bind(zmq.PULL, f"ipc://{d}/sock")
    assert not (d / "sock").exists()
    with pytest.raises(PermissionError):
        check_private_dir(str(d))


def test_ipc_in_private_dir_works(tmp_path, transports):
    d = tmp_path / "p"
    d.mkdir()
    os.chmod(d, 0o700)
    t = transports(secret=None)
    pull, addr = t.bind(zmq.PULL, f"ipc://{d}/s")
    assert addr == f"ipc://{d}/s"
    push = t.connect(zmq.PUSH, addr)
    push.send(FRONTEND_INPUT_CODEC.encode(_step()))
    assert pull.poll(5000)
    assert recv_message(pull, FRONTEND_INPUT_CODEC, DropCounter("t")) == _step()


def test_port_args_new_makes_private_dir():
    made = [PortArgs.new(dp_size=2), PortArgs.new()]
    dirs = [os.path.dirname(a.ready_ipc[len("ipc://"):]) for a in made]
    try:
        args, d = made[0], dirs[0]
        paths = [args.frontend_input_ipc, args.ready_ipc, *args.scheduler_input_ipcs]
        assert not args.is_tcp
        assert all(p.startswith(f"ipc://{d}/") for p in paths) and len(set(paths)) == 4
        assert args.scheduler_input_ipc == args.scheduler_input_ipcs[0]
        assert dirs[0] != dirs[1]  # a fresh directory each time
        for d in dirs:
            st = os.stat(d)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
            assert st.st_uid == os.getuid()
            check_private_dir(d)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


# ---- cluster secret ----------------------------------------------------------------------------
@pytest.fixture
def no_env_secret(monkeypatch):
    monkeypatch.delenv(environ.GRAMSYNC_CLUSTER_SECRET.name, raising=False)
    return monkeypatch


def _secret_file(tmp_path, content: str):
    p = tmp_path / "secret"
    p.write_text(content + "\n")
    os.chmod(p, 0o600)
    return str(p)


def test_short_secret_refused(tmp_path, no_env_secret):
    short = "x" * (MIN_SECRET_CHARS - 1)
    no_env_secret.setenv(environ.GRAMSYNC_CLUSTER_SECRET.name, short)
    with pytest.raises(ClusterSecretError, match=str(MIN_SECRET_CHARS)):
        load_cluster_secret(None)
    with pytest.raises(ClusterSecretError):
        require_secret(None)
    with pytest.raises(ClusterSecretError):
        load_cluster_secret(_secret_file(tmp_path, short))
    no_env_secret.setenv(environ.GRAMSYNC_CLUSTER_SECRET.name, "x" * MIN_SECRET_CHARS)
    assert load_cluster_secret(None) == "x" * MIN_SECRET_CHARS


def test_missing_secret(tmp_path, no_env_secret):
    assert load_cluster_secret(None) is None
    with pytest.raises(ClusterSecretError, match="GRAMSYNC_CLUSTER_SECRET"):
        require_secret(None)
    with pytest.raises(ClusterSecretError, match="cannot read"):
        load_cluster_secret(str(tmp_path / "does-not-exist"))


def test_keys_derive_from_secret():
    a, a2, b = CurveKeys.from_secret(SECRET), CurveKeys.from_secret(SECRET), \
        CurveKeys.from_secret(OTHER_SECRET)
    assert a == a2
    for field in ("server_public", "server_secret", "client_public", "client_secret"):
        assert getattr(a, field) != getattr(b, field)
        assert len(getattr(a, field)) == 40  # Z85 of 32 bytes
    assert a.server_public != a.client_public and a.server_secret != a.client_secret
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public


def test_secret_file_wins_over_env(tmp_path, no_env_secret):
    no_env_secret.setenv(environ.GRAMSYNC_CLUSTER_SECRET.name, SECRET)
    path = _secret_file(tmp_path, OTHER_SECRET)
    assert load_cluster_secret(path) == OTHER_SECRET
    assert require_secret(path) == OTHER_SECRET
    assert load_cluster_secret(None) == SECRET
    no_env_secret.delenv(environ.GRAMSYNC_CLUSTER_SECRET.name)
    assert load_cluster_secret(path) == OTHER_SECRET


# ---- schema $ref checks ------------------------------------------------------------------------
def test_local_refs_allowed():
    check_no_external_refs({"$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}})
    check_no_external_refs('{"properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {}}}')
    check_no_external_refs({"$dynamicRef": "#meta", "$recursiveRef": "#"})
    check_no_external_refs("not json at all")  # the backend reports that


@pytest.mark.parametrize("schema,key,path", [
    ({"$ref": "http://evil.example/s.json"}, "$ref", "at #"),
    ({"properties": {"a": {"$ref": "file:///etc/passwd"}}}, "$ref", "#/properties/a"),
    ({"items": [{}, {"$ref": "other.json#/a"}]}, "$ref", "#/items/1"),
    ({"$defs": {"m": {"$dynamicRef": "https://x.example/m"}}}, "$dynamicRef", "#/$defs/m"),
    ({"anyOf": [{"allOf": [{"$recursiveRef": "//host/s"}]}]}, "$recursiveRef", "#/anyOf/0/allOf/0"),
])
def test_external_refs_rejected_with_path(schema, key, path):
    for spec in (schema, json.dumps(schema)):
        with pytest.raises(ExternalRefError) as e:
            check_no_external_refs(spec)
        assert key in str(e.value) and path in str(e.value)
        assert isinstance(e.value, ValueError)  # the HTTP layer's 400


def test_ref_strings_as_data_allowed():
    check_no_external_refs({"const": {"$ref": "http://evil.example/"}})
    check_no_external_refs({"enum": [{"$ref": "file:///etc/passwd"}, "x"]})
    check_no_external_refs({"type": "object", "default": {"$ref": "http://x"},
                            "examples": [{"$ref": "http://y"}]})
    with pytest.raises(ExternalRefError):  # but not under an ordinary keyword
        check_no_external_refs({"not": {"$ref": "http://evil.example/"}})


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"enum": {"$ref": "http://evil.example/s.json"}}},
    {"$defs": {"default": {"$ref": "file:///etc/passwd"}}, "$ref": "#/$defs/default"},
])
def test_property_named_like_data_keyword_still_checked(schema):
    with pytest.raises(ExternalRefError):
        check_no_external_refs(schema)


def test_deep_nesting_no_recursion_error():
    depth = 50_000
    deep: object = []
    for _ in range(depth):
        deep = [deep]
    check_no_external_refs(deep)  # no RecursionError
    check_no_external_refs("[" * depth + "]" * depth)  # JSON too deep to parse: left to backend
    bad: object = {"$ref": "http://evil.example/"}
    for _ in range(depth):
        bad = [bad]
    with pytest.raises(ExternalRefError):  # the walk reaches the bottom
        check_no_external_refs(bad)
    nested: object = {"$ref": "#/x"}
    for _ in range(depth):
        nested = {"items": nested}
    check_no_external_refs(nested)


# ---- HTTP API keys -----------------------------------------------------------------------------
@pytest.mark.parametrize("api_key,admin_key,expected", [
    (None, None, {"/health": (), "/generate": (), "/abort_request": ()}),
    ("user", None, {"/health": (), "/generate": ("user",), "/abort_request": ("user",)}),
    # Only an admin key: the inference endpoints stay open, the admin ones need it.
    (None, "admin", {"/health": (), "/generate": (), "/abort_request": ("admin",)}),
    ("user", "admin", {"/health": (), "/generate": ("user", "admin"),
                       "/abort_request": ("admin",)}),
], ids=["no-keys", "api-key", "admin-key", "both-keys"])
def test_keys_for(api_key, admin_key, expected):
    cfg = HttpGuardConfig(api_key, admin_key, max_request_bytes=1 << 20)
    for path, keys in expected.items():
        assert cfg.keys_for(path) == keys, path
    assert cfg.keys_for("/get_server_info") == expected["/abort_request"]
    assert cfg.keys_for("/v1/chat/completions") == expected["/generate"]
    if api_key and admin_key:
        assert "user" not in cfg.keys_for("/abort_request")  # a user key is not an admin key


def test_scheduler_revalidates_requests_from_the_wire():
    """A well-typed request with values the frontend would refuse never reaches the
    scheduler: the entry rank's receiver re-validates it (and counts it as dropped)."""
    import dataclasses

    from srt.transport.request_receiver import validate_request

    good = _request()
    validate_request(good, 49152)
    nan = dataclasses.replace(good, sampling_params=dataclasses.replace(
        good.sampling_params, temperature=float("nan")))
    wire_nan = SCHEDULER_INPUT_CODEC.decode(SCHEDULER_INPUT_CODEC.encode(nan))
    with pytest.raises(ValueError, match="temperature"):
        validate_request(wire_nan, 49152)
    with pytest.raises(ValueError, match="input_ids"):
        validate_request(dataclasses.replace(good, input_ids=(49152,)), 49152)
    with pytest.raises(ValueError, match="input_ids"):
        validate_request(dataclasses.replace(good, input_ids=()), 49152)
