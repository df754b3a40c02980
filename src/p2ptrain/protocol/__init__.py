"""The protocol core (DESIGN §3-4): pure rules and window state machines, no I/O.

Every function takes data and returns data, clocks and randomness are passed in, and every
decision carries its reason (a :class:`~p2ptrain.core.certificate.Verdict` or a record with
a ``reason``). The node (real sockets) and the simulator (virtual ones) drive the same code.
"""
