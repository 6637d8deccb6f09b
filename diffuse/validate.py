"""Decoded values from others (CBOR from peers, JSON from API clients) checked into typed structs.

One mechanism for all of them: a msgspec Struct declares each field's type and bounds, and
`convert` checks a decoded value against it strictly (bool is not an int, a string is not bytes;
the one conversion is an integer where a float is due), so hand-written checks remain only for
rules across fields (a struct's `__post_init__`). Failures name the offending field, as the
API's 400s and the reasons records are refused with need.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

T = TypeVar("T")

Count = Annotated[int, Meta(ge=0, le=2**53 - 1)]  # a non-negative integer any JSON reader holds exactly
Text = Annotated[str, Meta(max_length=256)]  # a name or an address: short
Hash = Annotated[bytes, Meta(min_length=32, max_length=32)]  # SHA-256 digests and commitments
PeerIdBytes = Annotated[bytes, Meta(max_length=64)]  # a binary peer id, whether it is one checked after
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # no NaN, no infinities
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]

_AT = re.compile(r"(?P<why>.*?)(?: - at `(?P<key>key` in `)?\$\.?(?P<at>[^`]*)`)?", re.S)
_NAMED = re.compile(r"object (missing required|contains unknown) field `([^`]*)`")


class Malformed(ValueError):
    """A value not of its declared shape; `field` is the path of the offending field
    (e.g. "messages[0].role"), None for the value as a whole."""

    def __init__(self, reason: str, field: str | None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.reason, self.field = reason, field


def convert(value: Any, type_: type[T]) -> T:
    """`value` (as decoded, bytes as bytes) checked into `type_`; Malformed where it is not one."""
    try:
        return msgspec.convert(value, type_, strict=True, builtin_types=(bytes,))
    except msgspec.ValidationError as e:
        raise _malformed(str(e)) from None


def _malformed(message: str) -> Malformed:
    """msgspec's message recast as (field path, reason), e.g. ("stop", "expected `array` of length <= 4")."""
    m = _AT.fullmatch(message)
    assert m is not None  # every message matches: the location is optional
    why, at = m["why"][:1].lower() + m["why"][1:], m["at"] or ""
    named = _NAMED.fullmatch(why)
    if named:
        at = f"{at}.{named[2]}" if at else named[2]
        why = "required but missing" if named[1] == "missing required" else "not a known field"
    return Malformed(f"a key: {why}" if m["key"] else why, at or None)
