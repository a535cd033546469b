"""Framed messages between the service, its zygotes and the candidate processes.

A frame is a JSON header plus an optional binary payload (output tensors), each preceded by
its length. Everything a candidate process sends is untrusted: lengths are capped, the
header must be a JSON object, and nothing is ever unpickled.

The service talks to a zygote over a SOCK_SEQPACKET pair (one JSON object per packet, file
descriptors passed alongside); to a candidate process over a SOCK_STREAM pair with frames.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

_LENGTHS = struct.Struct("!IQ")  # header bytes, payload bytes
MAX_HEADER_BYTES = 1 << 20
MAX_PACKET_BYTES = 1 << 16


class WireError(Exception):
    """The other side closed, timed out, or sent something malformed."""


class WireTimeout(WireError):
    """No complete frame arrived before the deadline."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LENGTHS.pack(len(data), len(payload)) + data)
    if len(payload):
        sock.sendall(payload)


def _recv_exactly(sock: socket.socket, count: int, deadline: float | None) -> bytearray:
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WireTimeout("timed out")
            sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:], count - got)
        except TimeoutError:
            raise WireTimeout("timed out") from None
        except OSError as err:
            raise WireError(str(err)) from None
        if n == 0:
            raise WireError("closed")
        got += n
    return buffer


def recv_frame(sock: socket.socket, *, deadline: float | None = None,
               max_payload: int = 1 << 34) -> tuple[dict[str, Any], bytearray]:
    """One frame: (header, payload). Raises WireTimeout after `deadline` (time.monotonic)."""
    header_size, payload_size = _LENGTHS.unpack(_recv_exactly(sock, _LENGTHS.size, deadline))
    if header_size > MAX_HEADER_BYTES or payload_size > max_payload:
        raise WireError(f"frame too large ({header_size} header bytes, {payload_size} payload bytes)")
    try:
        header = json.loads(_recv_exactly(sock, header_size, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"malformed header: {err}") from None
    if not isinstance(header, dict):
        raise WireError("header is not an object")
    payload = _recv_exactly(sock, payload_size, deadline) if payload_size else bytearray()
    return header, payload


def send_packet(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_PACKET_BYTES:
        raise WireError(f"control message of {len(data)} bytes is over {MAX_PACKET_BYTES}")
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def recv_packet(sock: socket.socket, timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
    sock.settimeout(timeout)
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET_BYTES, 4)
    except TimeoutError:
        raise WireTimeout("timed out") from None
    except OSError as err:
        raise WireError(str(err)) from None
    if not data:
        raise WireError("closed")
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"malformed control message: {err}") from None
    return message, list(fds)
