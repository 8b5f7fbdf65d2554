"""`shape_buckets` in a config.pbtxt, whose ModelConfig has no such field: one `mpsd.shape_buckets.*`
parameter per value, the way mpsd carries its other settings there (docs/configuration.md#shapebuckets).

    mpsd.shape_buckets.inputs.<INPUT>.dim        "1"
    mpsd.shape_buckets.inputs.<INPUT>.sizes      "16,32,64,128"
    mpsd.shape_buckets.inputs.<INPUT>.pad_value  "0"
    mpsd.shape_buckets.mask_input                "ATTENTION_MASK"   (or .name, .follows, .data_type)
    mpsd.shape_buckets.outputs.<OUTPUT>.dim      "1"
    mpsd.shape_buckets.outputs.<OUTPUT>.follows  "INPUT_IDS"

The parameters become the same fields a config.yaml holds, as text, so one validation (pydantic's types and
`shape_buckets.py`'s rules) answers both formats with the same words. A tensor name may hold dots: the
field is the key's last part. Pure string mapping, no protobuf: importable anywhere.
"""

from __future__ import annotations

from typing import Any

from mpsd.config.model_schema import ShapeBuckets

PREFIX = "shape_buckets"  # after mpsd.
FORMS = (
    "shape_buckets.inputs.NAME.(dim|sizes|pad_value), shape_buckets.mask_input[.(name|follows|data_type)], "
    "shape_buckets.outputs.NAME.(dim|follows)"
)


def read_bucket_parameter(name: str, value: str, out: dict[str, Any]) -> bool:
    """Put one `shape_buckets.*` parameter (`name` without `mpsd.`) into the config fields `out`; False when
    the key has none of the forms (the caller refuses it, naming them)."""
    rest = name.removeprefix(PREFIX + ".")
    buckets = out.setdefault("shape_buckets", {})
    if rest == "mask_input":
        _mask(buckets)["name"] = value
        return True
    section, _, tail = rest.partition(".")
    if section == "mask_input" and tail and "." not in tail:
        _mask(buckets)[tail] = value
        return True
    tensor, _, field = tail.rpartition(".")
    if section not in ("inputs", "outputs") or not tensor or not field:
        return False
    entry = buckets.setdefault(section, {}).setdefault(tensor, {})
    entry[field] = _sizes(value) if field == "sizes" else value
    return True


def _mask(buckets: dict[str, Any]) -> dict[str, Any]:
    mask: dict[str, Any] = buckets.setdefault("mask_input", {})
    return mask


def _sizes(value: str) -> list[str]:
    """ "16, 32,64" as the list a config.yaml holds (its items still text: validation reads them)."""
    return [part.strip() for part in value.strip().strip("[]").split(",") if part.strip()]


def bucket_parameters(buckets: ShapeBuckets) -> dict[str, str]:
    """The `mpsd.shape_buckets.*` parameters (keys without `mpsd.`) that read back as `buckets`."""
    out: dict[str, str] = {}
    for tensor, bucketed in buckets.inputs.items():
        key = f"{PREFIX}.inputs.{tensor}"
        out[f"{key}.dim"] = str(bucketed.dim)
        out[f"{key}.sizes"] = ",".join(map(str, bucketed.sizes))
        out[f"{key}.pad_value"] = _number(bucketed.pad_value)
    mask = buckets.mask_input
    if mask is not None:
        out[f"{PREFIX}.mask_input.name"] = mask.name
        if mask.follows is not None:
            out[f"{PREFIX}.mask_input.follows"] = mask.follows
        out[f"{PREFIX}.mask_input.data_type"] = mask.data_type
    for tensor, cut in buckets.outputs.items():
        out[f"{PREFIX}.outputs.{tensor}.dim"] = str(cut.dim)
        out[f"{PREFIX}.outputs.{tensor}.follows"] = cut.follows
    return out


def _number(value: float) -> str:
    """A pad value as written by hand: "0", "-1", "0.5"."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
