"""Batching, in one home: `queue` forms batches out of a version's waiting requests, `marshal` lays a
batch's tensors out in a worker's shared memory and splits its outputs back per request."""
