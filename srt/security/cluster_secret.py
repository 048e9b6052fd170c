"""The cluster secret: what a peer must hold to talk to a node's ZMQ sockets over TCP.

Every node of a multi-node server reads the same secret (``--cluster-secret-file`` or
``GRAMSYNC_CLUSTER_SECRET``). From it each process derives the same two CURVE key pairs
(server and client), so nothing but the secret has to be distributed: a binding socket
only completes a handshake with a peer that proves it holds the client key, and a
connecting peer only reaches a server that holds the server key. Messages are then
encrypted too (prompts and outputs cross the cluster network).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Optional

import zmq
from zmq.utils import z85

from srt import environ

logger = logging.getLogger(__name__)
MIN_SECRET_CHARS = 32


class ClusterSecretError(ValueError):
    """No usable cluster secret; the message says how to provide one."""


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs derived from the cluster secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> "CurveKeys":
        def pair(role: bytes) -> tuple[bytes, bytes]:
            raw = hmac.new(secret.encode(), b"gramsync curve " + role, hashlib.sha256).digest()
            sk = z85.encode(raw)
            return zmq.curve_public(sk), sk

        server_public, server_secret = pair(b"server")
        client_public, client_secret = pair(b"client")
        return cls(server_public, server_secret, client_public, client_secret)


def generate_secret() -> str:
    return secrets.token_hex(32)


def read_secret_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ClusterSecretError(f"cannot read --cluster-secret-file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("cluster secret file %s is readable by other users (mode %o); "
                       "chmod 600 it", path, stat.S_IMODE(st.st_mode))
    return secret


def load_cluster_secret(secret_file: Optional[str]) -> Optional[str]:
    """The configured secret (the file wins over the environment), or None."""
    secret = read_secret_file(secret_file) if secret_file else environ.GRAMSYNC_CLUSTER_SECRET.get()
    if not secret:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ClusterSecretError(
            f"the cluster secret is {len(secret)} characters long; use at least "
            f"{MIN_SECRET_CHARS} random ones (e.g. {generate_secret()})")
    return secret


def missing_secret_help(generated: Optional[str] = None) -> str:
    example = generated or generate_secret()
    return ("A multi-node server needs a cluster secret shared by every node, so that only "
            "its own nodes can talk to its sockets. Give every node the same secret: "
            f"`export GRAMSYNC_CLUSTER_SECRET={example}` or `--cluster-secret-file FILE` "
            "(a file holding it, mode 600). scripts/slurm_gramsync.sbatch makes one for you; "
            "scripts/torchrun_multinode.sh passes GRAMSYNC_CLUSTER_SECRET through.")


def secret_for_node0(secret_file: Optional[str]) -> str:
    """Node 0 without torchrun: the configured secret, or a new one it prints with the
    command line the other nodes need (and exports, so this node's ranks inherit it)."""
    secret = load_cluster_secret(secret_file)
    if secret is None:
        secret = generate_secret()
        path = _write_generated(secret)
        logger.warning(
            "No cluster secret was given; generated one (saved to %s, mode 600). Start every "
            "other node with the same secret: GRAMSYNC_CLUSTER_SECRET=%s python launch.py ... "
            "(or copy the file and pass --cluster-secret-file).", path, secret)
    os.environ[environ.GRAMSYNC_CLUSTER_SECRET.name] = secret
    return secret


def require_secret(secret_file: Optional[str]) -> str:
    secret = load_cluster_secret(secret_file)
    if secret is None:
        raise ClusterSecretError(missing_secret_help())
    return secret


def _write_generated(secret: str) -> str:
    d = environ.GRAMSYNC_CACHE_DIR.get()
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, "cluster_secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    return path
