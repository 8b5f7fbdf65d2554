"""The rules of `shape_buckets` (an mpsd extension): which inputs, dims and outputs it may name.

A bucketed dim is a variable (-1) dim of a numeric input; the daemon pads it to the smallest of its sizes that
holds a batch's longest request, so requests of different lengths share an execution and the model sees a
few shapes only. Outputs that follow a bucketed input are cut back to each request's own length; the mask
input, if named, is made by the daemon (so it is not in the config's `input` list).
"""

from __future__ import annotations

from mpsd.config.model_schema import ModelFields, TensorConfig


def _variable_dim(config: ModelFields, tensor: TensorConfig, dim: int, where: str) -> None:
    """`dim` (counted with the batch dimension when batching) is a variable dim of `tensor`'s dims."""
    batched = config.max_batch_size > 0
    if batched and dim == 0:
        raise ValueError(f"{where}: dim 0 is the batch dimension, which is not bucketed")
    index = dim - 1 if batched else dim
    if index >= len(tensor.dims) or tensor.dims[index] != -1:
        counted = " (counting the batch dimension as 0)" if batched else ""
        raise ValueError(
            f"{where}: dim {dim}{counted} is not a variable (-1) dim of '{tensor.name}', whose dims are "
            f"{tensor.dims}",
        )
    if tensor.data_type == "TYPE_STRING":
        raise ValueError(f"{where}: '{tensor.name}' is TYPE_STRING; only numbers are padded")


def check_buckets(config: ModelFields) -> None:
    """The first broken rule of the config's `shape_buckets`, as a ValueError (placed at `shape_buckets` by
    model_rules); nothing without one."""
    buckets = config.shape_buckets
    if buckets is None:
        return
    for other in ("sequence_batching", "ensemble_scheduling"):
        if getattr(config, other) is not None:
            raise ValueError(f"shape_buckets and {other} do not go together")
    if config.model_transaction_policy.decoupled:
        raise ValueError("shape_buckets is not supported for a decoupled model")
    inputs, outputs = config.input_by_name, config.output_by_name
    for name, bucketed in buckets.inputs.items():
        tensor = inputs.get(name)
        if tensor is None:
            raise ValueError(
                f"shape_buckets.inputs: the model has no input '{name}' (its: {', '.join(inputs)})"
            )
        _variable_dim(config, tensor, bucketed.dim, f"shape_buckets.inputs '{name}'")
    mask = buckets.mask_input
    if mask is not None:
        where = f"shape_buckets.mask_input '{mask.name}'"
        if mask.name in inputs:
            raise ValueError(
                f"{where} is also an input: the daemon makes it, so the input list leaves it out"
            )
        if mask.follows is None and len(buckets.inputs) > 1:
            raise ValueError(f"{where}: name the bucketed input it follows (follows: ...)")
        if mask.follows is not None and mask.follows not in buckets.inputs:
            raise ValueError(f"{where}: follows '{mask.follows}', which is not a bucketed input")
        if mask.data_type == "TYPE_STRING":
            raise ValueError(f"{where}: data_type must be numeric")
    for name, cut in buckets.outputs.items():
        where = f"shape_buckets.outputs '{name}'"
        output = outputs.get(name)
        if output is None:
            raise ValueError(
                f"shape_buckets.outputs: the model has no output '{name}' (its: {', '.join(outputs)})"
            )
        if cut.follows not in buckets.inputs:
            raise ValueError(f"{where}: follows '{cut.follows}', which is not a bucketed input")
        _variable_dim(config, output, cut.dim, where)


def mask_follows(config: ModelFields) -> str | None:
    """The bucketed input the mask input marks, or None without a mask input."""
    buckets = config.shape_buckets
    if buckets is None or buckets.mask_input is None:
        return None
    return buckets.mask_input.follows or next(iter(buckets.inputs))
