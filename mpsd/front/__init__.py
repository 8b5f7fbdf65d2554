"""A front process: a gRPC server sharing the daemon's port, handing calls to the daemon."""
