"""Triton's gRPC protocol: the servicers (inference, health, admin), the method gate and decoding guard, and
the ModelInfer fast paths (the wire split, known headers, response templates)."""
