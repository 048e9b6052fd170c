"""One process's ZMQ sockets, made safe for the endpoints they use.

- ``ipc://`` (one node): the socket files live in a private directory (mode 0700, owned
  by us); binding anywhere else is refused, so other local users cannot connect.
- ``tcp://`` (between nodes): CURVE, with keys derived from the cluster secret. A bound
  socket completes a handshake only with a peer holding the client key (checked by a ZAP
  handler, pyzmq's ``ThreadAuthenticator``); everything is encrypted. Bound sockets take
  the node's cluster address, never every interface. Refused handshakes are counted and
  logged (a socket monitor), as are malformed messages (``wire.DropCounter``).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import threading
from typing import Optional

import zmq

from srt.transport.wire import MAX_MESSAGE_BYTES
from srt.security.cluster_secret import CurveKeys, require_secret
from srt.security.private_dir import private_dir_problem

logger = logging.getLogger(__name__)
_REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def check_private_dir(path: str) -> None:
    """Refuse IPC endpoints in a directory other local users can reach."""
    problem = private_dir_problem(path, "IPC directory")
    if problem is not None:
        raise PermissionError(problem)


def _is_every_interface(host: str) -> bool:
    host = host.strip("[]")
    if host in ("*", ""):
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_unspecified
    except (OSError, ValueError):
        try:
            return ipaddress.ip_address(host).is_unspecified  # an IPv6 literal
        except ValueError:
            return False  # an interface name: libzmq binds that interface only


class _ClientKeyCheck:
    """ZAP credentials provider: only the cluster's client key may connect."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


class ZmqTransport:
    def __init__(self, keys: Optional[CurveKeys] = None, name: str = "gramsync"):
        self.ctx = zmq.Context()
        self.keys = keys
        self.name = name
        self.refused_handshakes = 0
        self._auth = None
        self._monitors: list[threading.Thread] = []
        self._stop = threading.Event()
        self._sockets: list[zmq.Socket] = []

    # ---- sockets ------------------------------------------------------------------
    def bind(self, sock_type: int, addr: str) -> tuple[zmq.Socket, str]:
        """Bind ``addr`` (``tcp://HOST:0`` picks a free port); returns (socket, address)."""
        sock = self._socket(sock_type)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if addr.startswith("tcp://"):
            self._require_keys(addr)
            self._start_authenticator()
            sock.curve_server = True
            sock.curve_secretkey = self.keys.server_secret
            sock.curve_publickey = self.keys.server_public
            host, _, port = addr[len("tcp://"):].rpartition(":")
            if _is_every_interface(host):
                raise ValueError(f"refusing to bind {addr} on every interface: bind the node's "
                                 "cluster address (GRAMSYNC_HOST_IP)")
            if port == "0":
                addr = f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
            else:
                sock.bind(addr)
            self._watch_handshakes(sock, addr)
        else:
            if addr.startswith("ipc://"):
                check_private_dir(os.path.dirname(addr[len("ipc://"):]))
            sock.bind(addr)
        return sock, addr

    def connect(self, sock_type: int, addr: str) -> zmq.Socket:
        sock = self._socket(sock_type)
        if addr.startswith("tcp://"):
            self._require_keys(addr)
            sock.curve_serverkey = self.keys.server_public
            sock.curve_publickey = self.keys.client_public
            sock.curve_secretkey = self.keys.client_secret
        sock.connect(addr)
        return sock

    def _socket(self, sock_type: int) -> zmq.Socket:
        sock = self.ctx.socket(sock_type)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    def _require_keys(self, addr: str) -> None:
        if self.keys is None:
            raise RuntimeError(f"{addr}: TCP endpoints need the cluster secret "
                               "(--cluster-secret-file or GRAMSYNC_CLUSTER_SECRET)")

    # ---- authentication and refusals -------------------------------------------------
    def _start_authenticator(self) -> None:
        if self._auth is not None:
            return
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("gramsync.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", _ClientKeyCheck(self.keys.client_public))

    def _watch_handshakes(self, sock: zmq.Socket, addr: str) -> None:
        endpoint = f"inproc://gramsync-monitor-{id(sock)}"
        sock.monitor(endpoint, _REFUSED_EVENTS)
        pair = self.ctx.socket(zmq.PAIR)
        pair.connect(endpoint)

        def loop():
            from zmq.utils.monitor import recv_monitor_message

            try:
                while not self._stop.is_set():
                    if not pair.poll(200):
                        continue
                    event = recv_monitor_message(pair)
                    self.refused_handshakes += 1
                    n = self.refused_handshakes
                    if n <= 10 or n % 1000 == 0:
                        logger.warning("%s: refused a handshake on %s (a peer without the "
                                       "cluster secret; zmq event %d); %d refused so far",
                                       self.name, addr, event["event"], n)
            except zmq.ZMQError:
                pass  # context closing
            finally:
                pair.close(0)

        t = threading.Thread(target=loop, daemon=True, name=f"zmq-monitor-{addr}")
        t.start()
        self._monitors.append(t)

    # ---- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        for t in self._monitors:
            t.join(1.0)
        if self._auth is not None:
            self._auth.stop()
        for sock in self._sockets:
            if not sock.closed:
                sock.close(0)
        self.ctx.term()


def transport_for(port_args, secret_file: Optional[str], name: str) -> ZmqTransport:
    """A transport for ``port_args``' endpoints: CURVE keys when they are TCP (this raises
    ClusterSecretError, with instructions, if no cluster secret is configured)."""
    keys = CurveKeys.from_secret(require_secret(secret_file)) if port_args.is_tcp else None
    return ZmqTransport(keys, name)
