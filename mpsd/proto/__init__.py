"""Generated protobuf and gRPC modules for mpsd; `make proto` regenerates them from proto/."""
