"""mpsd: a gRPC model server for PyTorch on Apple Silicon (MPS) and Linux (CUDA/CPU)."""

__version__ = "0.1.0"
