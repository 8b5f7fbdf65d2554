"""The daemon side: gRPC front, request validation, routing, model lifecycle and worker supervision."""
