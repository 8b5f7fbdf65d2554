"""Front processes: more cores for gRPC, one place where requests meet.

One Python process spends most of a small request's CPU time in gRPC itself (HTTP/2, the asyncio
machinery), so one front caps a daemon at a few thousand requests per second. With `front_processes: N`
the daemon starts N front processes that share the TCP port through SO_REUSEPORT (the kernel spreads
connections over them) and keeps the rest here: the registry, the batcher and the workers. With
`front_ports` each front listens on a port of its own instead, for clients that spread their calls over the
ports (macOS cannot spread one port's connections); the daemon then serves grpc_address itself too.

A front hands ModelInfer calls to the daemon as serialized bytes over a socketpair (`mpsd/ipc/front_wire.py`),
large ones through a shared-memory arena the daemon creates for it (`mpsd/ipc/front_arena.py`); the
daemon decodes, validates, batches and answers with serialized bytes, so gRPC runs in the fronts and
mpsd's own work here. Every other RPC the front forwards unchanged to the daemon's gRPC server on a
private Unix socket, so the daemon stays the one place that holds state.

One module per job: `policy` (how many fronts, whether the port is free), `sockets` (the daemon's private
socket directory), `link` (the daemon's end of one front's socketpair), `pool` (starting, supervising and
stopping the processes) and `relay` (their log events into the daemon's).
"""
