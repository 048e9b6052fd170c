"""Where a node's compile pool listens: a fresh ``mkdtemp`` directory (mode 0700, ours) made
by the node's first rank, whose path reaches the node's other ranks over torch.distributed
(``distributed/node_share.py``). Nothing about it can be guessed in advance, and the
service (before binding) and every rank (before connecting) check it: a directory another
local user made, or could enter, would let them stop constrained requests or answer them
with grammars of their own."""
from __future__ import annotations

import os
import stat
import tempfile
from typing import Optional

from srt.security.private_dir import private_dir_problem

SOCKET_NAME = "pool"


def new_pool_dir() -> str:
    return tempfile.mkdtemp(prefix="gramsync-grammar-")  # 0700, owned by us, unpredictable


def pool_socket_address(directory: str) -> str:
    return f"ipc://{os.path.join(directory, SOCKET_NAME)}"


def pool_dir_problem(directory: str) -> Optional[str]:
    """None if ``directory`` is private to us (srt/security/private_dir.py), else why not."""
    return private_dir_problem(directory, "grammar pool directory")


def pool_endpoint_problem(address: str) -> Optional[str]:
    """What a rank checks before connecting to ``address`` (``ipc://DIR/pool``): DIR is
    private, and the socket file, if it exists yet, is a socket owned by us."""
    if not address.startswith("ipc://"):
        return f"grammar pool address {address} is not an IPC file"
    path = address[len("ipc://"):]
    problem = pool_dir_problem(os.path.dirname(path))
    if problem is not None:
        return problem
    try:
        st = os.lstat(path)
    except FileNotFoundError:  # the service has not bound yet: ZMQ connects once it has
        return None
    except OSError as e:
        return f"grammar pool socket {path} cannot be read ({e.strerror})"
    if not stat.S_ISSOCK(st.st_mode):
        return f"grammar pool socket {path} is not a socket"
    if st.st_uid != os.getuid():
        return f"grammar pool socket {path} is owned by uid {st.st_uid}, not {os.getuid()}"
    return None
