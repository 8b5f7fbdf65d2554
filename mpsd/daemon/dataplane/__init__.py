"""The data plane: everything between a checked request for a model version and its answer. The queue and
batch forming, marshalling into a worker's shared memory and the channel to the worker. It knows no wire
format and no process: the adapters above hand it typed requests, and supervision hands it ready workers."""
