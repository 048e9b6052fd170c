"""Messages between the processes: the typed wire codec, ZMQ sockets, the scheduler's request receiver."""
