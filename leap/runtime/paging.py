"""Opaque page tokens for the List* RPCs, checked when they come back.

A token is the URL-safe base64 of a small JSON object: a version, a digest of the query it
belongs to (the request's filters, not its page_size, which may change between pages as
AIP-158 allows) and the position of the next page. Clients treat it as opaque; the service
accepts only a token it could have issued for the same query, with a well-formed position,
so a hand-made "-5" or a token of another query is INVALID_ARGUMENT naming `page_token`
instead of a page from an arbitrary place.

    token = encode_page_token(offset + size, {"split": request.split})
    offset = decode_page_token(request.page_token, {"split": request.split}, is_offset)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

VERSION = 1
MAX_TOKEN_CHARS = 1024


def _digest(query: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(query), sort_keys=True, default=str).encode()).hexdigest()[:16]


def encode_page_token(position: Any, query: Mapping[str, Any]) -> str:
    """The token of the page at `position` (JSON: a number, a string or a list of them)."""
    body = json.dumps({"v": VERSION, "q": _digest(query), "p": position}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def decode_page_token(token: str, query: Mapping[str, Any], valid: Callable[[Any], bool]) -> Any:
    """The position of a token `encode_page_token` issued for `query`; ValueError saying why
    when it is not one (garbage, another query's, a position `valid` refuses)."""
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"it is {len(token)} characters; tokens this service issues are far shorter")
    try:
        body = json.loads(base64.urlsafe_b64decode((token + "=" * (-len(token) % 4)).encode("ascii")),
                          parse_constant=lambda name: math.nan)
    except (ValueError, UnicodeError, binascii.Error):
        raise ValueError("it is not a page token of this service") from None
    if not isinstance(body, dict) or body.get("v") != VERSION or "p" not in body:
        raise ValueError("it is not a page token of this service")
    if body.get("q") != _digest(query):
        raise ValueError("it belongs to a different query (filters must stay the same from page to page)")
    if not valid(body["p"]):
        raise ValueError("its position is not valid")
    return body["p"]


def is_offset(position: Any) -> bool:
    """A non-negative integer offset."""
    return isinstance(position, int) and not isinstance(position, bool) and position >= 0
