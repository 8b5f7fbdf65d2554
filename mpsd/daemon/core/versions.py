"""The version a request names, read from the protocol's string as Triton reads it (server's
common.cc, `GetModelVersionFromString`), with Triton's errors, before the model is looked up.

One difference, on purpose: Triton's std::stol takes the leading digits of "1.5" or "7abc" as version 1
or 7; here a string that is not wholly an integer is refused, so a request never runs on a version its
client did not name.
"""

from __future__ import annotations

import re

from mpsd.errors import BadVersion

_INTEGER = re.compile(r"[+-]?[0-9]+")
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1  # std::stol's range where Triton runs (64-bit long)


def requested_version(text: str) -> int | None:
    """The version number, None for "" (the latest); BadVersion for anything else."""
    if not text:
        return None
    if not ((text.isascii() and text.isdigit()) or _INTEGER.fullmatch(text)):  # digits: no expression run
        raise BadVersion(text)
    number = int(text) if len(text) <= 40 else _LONG_MAX + 1  # no conversion of 10,000 digits
    if not _LONG_MIN <= number <= _LONG_MAX:  # std::stol's out_of_range: the same message
        raise BadVersion(text)
    if number < 0:
        raise BadVersion(text, negative=True)
    return number
