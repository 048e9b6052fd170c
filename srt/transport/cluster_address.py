"""Which address of this node its cluster sockets bind (never every interface).

Node 0 binds the host of ``--dist-init-addr`` / ``MASTER_ADDR`` (the address the other
nodes already use to reach it); another node binds the address of its interface that
routes to node 0. ``GRAMSYNC_HOST_IP`` overrides both.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Optional

from srt import environ

logger = logging.getLogger(__name__)


def reachable_ip(peer: str) -> str:
    """This host's address on the interface that routes to ``peer`` (a UDP "connect"
    only picks the route and sends nothing); falls back to the hostname's."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def node0_address(node0_host: str) -> str:
    """Node 0's own cluster address: GRAMSYNC_HOST_IP, else ``node0_host`` as an IP."""
    explicit = environ.GRAMSYNC_HOST_IP.get()
    if explicit:
        return explicit
    addr = socket.gethostbyname(node0_host)
    if ipaddress.ip_address(addr).is_loopback and addr != node0_host:
        logger.warning("node 0's address %s resolves to the loopback address %s: other machines "
                       "cannot reach node 0's sockets there; set GRAMSYNC_HOST_IP or give "
                       "--dist-init-addr as an IP", node0_host, addr)
    return addr


def this_node_address(init_method: str) -> Optional[str]:
    """This node's cluster address, as seen from node 0 (None on a single node)."""
    explicit = environ.GRAMSYNC_HOST_IP.get()
    if explicit:
        return explicit
    if init_method.startswith("tcp://"):
        return reachable_ip(init_method[len("tcp://"):].rsplit(":", 1)[0])
    master = os.environ.get("MASTER_ADDR")
    return reachable_ip(master) if master else None
