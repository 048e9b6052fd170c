"""The node's grammar compile pool: worker processes that compile every grammar a node's
ranks ask for, once per node, at the lowest CPU priority, killable at a timeout.

service.py (one process per node, started by the node's first rank) <- client.py (one per
rank) over a private IPC socket; worker.py (the compiling processes, children of the
service); messages.py (what crosses those boundaries); private_dir.py (the socket's fresh
0700 directory, and the checks made before binding and connecting)."""
