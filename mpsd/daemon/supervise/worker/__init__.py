"""The daemon's handle on one worker process, split by job: `process` (spawn, stop, reap, output),
`liveness` (heartbeats, watchdog, memory ceilings), `channel` (executions in flight on the worker's socket)
and `handle` (`WorkerProcess`, the one interface an instance uses)."""
