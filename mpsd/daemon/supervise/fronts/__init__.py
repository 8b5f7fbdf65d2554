"""Front processes: more cores for gRPC, one place where requests meet (see `pool`)."""
