"""The HTTP port, bound before anything else starts.

uvicorn binds its port only once the ranks are ready, tens of seconds after the start:
meanwhile the port was free for anyone, the ranks' own gloo sockets included (they take
ephemeral ports, and the kernel may hand them a port the user named). Binding first holds
the port from the start, and a taken port fails in a second with a clear message instead
of after the model has loaded. The socket is bound, not listening: a client gets
"connection refused" until the server is ready, as before."""
from __future__ import annotations

import socket


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host:port`` (IPv4 or IPv6, as ``host`` resolves), handed to
    uvicorn later. Raises RuntimeError naming the address and the reason."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise RuntimeError(f"cannot resolve --host {host!r}: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no bar
        sock.bind(addr)
    except OSError as e:
        sock.close()
        reason = (e.strerror or str(e)).lower()
        raise RuntimeError(f"cannot bind the HTTP port {host}:{port}: {reason} "
                           "(is another server running there? choose another --port)") from None
    return sock
