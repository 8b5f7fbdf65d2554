"""Triton's HTTP/REST protocol (KServe v2 and Triton's extensions): the daemon's second protocol adapter.

Like the gRPC servicers it translates requests onto `api.operations`, so both protocols share one
validation, one queue per model, one set of statistics. `server` runs it on the daemon's event loop,
`routes` maps Triton's paths, `handlers` and `infer` translate, `body` reads an infer body (JSON and
binary tensor data), `responses` writes Triton's JSON, `middleware` drains, checks access and turns
errors into statuses.
"""
