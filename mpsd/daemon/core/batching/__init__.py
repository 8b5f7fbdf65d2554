"""Batching, in one home: `queue` forms batches out of a version's waiting requests."""
