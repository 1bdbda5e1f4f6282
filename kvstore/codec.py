"""Typed msgpack encoding of the messages declared in protocol.py, and the frame headers.

A message travels as a msgpack map of its fields. Decoding checks every field against the dataclass's
annotations (exact types: a bool is not an int, a str is not bytes, ints fit in int64), refuses unknown
and missing fields, then runs the message's own validation. Failures become ProtocolError subclasses
(the daemon answers them, the client raises them), never a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import msgpack

from .errors import InvalidArgument, InvalidMessage, MessageTooLarge, ProtocolError, VersionMismatch
from .protocol import MAGIC, MAX_BODY_BYTES, PROTOCOL_VERSION, REPLY_HEADER, REQUEST_HEADER, ErrorReply, Status

_INT64 = range(-(1 << 63), 1 << 63)
_SCALARS = (str, bytes, bool)
_MAX_ERROR_CHARS = 2000


def encode(msg: Any) -> bytes:
    return msgpack.packb(_plain(msg), use_bin_type=True)


def decode(cls: type, body: bytes) -> Any:
    if len(body) > MAX_BODY_BYTES:
        raise MessageTooLarge(f"message body of {len(body)} bytes exceeds the limit of {MAX_BODY_BYTES}")
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"body is not one valid msgpack value: {type(e).__name__}: {e}") from None
    return _build(cls, raw, cls.__name__)


def request_frames(opcode: int, call_id: int, session: int, msg: Any) -> list[bytes]:
    return [REQUEST_HEADER.pack(MAGIC, PROTOCOL_VERSION, opcode, call_id, session), encode(msg)]


def parse_request_header(frame: bytes) -> tuple[int, int, int, int]:
    """(version, opcode, call_id, session) of a request header."""
    if len(frame) != REQUEST_HEADER.size:
        raise ProtocolError(f"request header must be {REQUEST_HEADER.size} bytes, got {len(frame)}")
    magic, version, opcode, call_id, session = REQUEST_HEADER.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError(f"request header does not start with {MAGIC!r}: not a kvstore client")
    return version, opcode, call_id, session


def reply_frames(opcode: int, call_id: int, msg: Any) -> list[bytes]:
    return [REPLY_HEADER.pack(MAGIC, PROTOCOL_VERSION, opcode, Status.OK, call_id), encode(msg)]


def error_frames(opcode: int, call_id: int, code: int, message: str) -> list[bytes]:
    body = encode(ErrorReply(int(code), message[:_MAX_ERROR_CHARS]))
    return [REPLY_HEADER.pack(MAGIC, PROTOCOL_VERSION, opcode, Status.ERROR, call_id), body]


def parse_reply(frames: list[bytes]) -> tuple[int, Status, int, bytes]:
    """(opcode, status, call_id, body) of a reply. A reply from another protocol version is only
    trusted when it is an error (ErrorReply never changes): that is how a client learns of a mismatch."""
    if len(frames) != 2 or len(frames[0]) != REPLY_HEADER.size:
        raise ProtocolError(f"reply must be [header of {REPLY_HEADER.size} bytes, body], got {len(frames)} frames")
    magic, version, opcode, status, call_id = REPLY_HEADER.unpack(frames[0])
    if magic != MAGIC or status not in (Status.OK, Status.ERROR):
        raise ProtocolError("reply header is not a kvstore reply")
    if version != PROTOCOL_VERSION and status != Status.ERROR:
        raise VersionMismatch(f"daemon speaks protocol {version}, this client speaks {PROTOCOL_VERSION}")
    return opcode, Status(status), call_id, frames[1]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if type(value) is list and value and (type(value[0]) is list or dataclasses.is_dataclass(value[0])):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = frozenset(
        f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return {f.name: hints[f.name] for f in fields}, required


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _build(tp: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        if type(value) is not dict:
            raise InvalidMessage(f"{where} must be a map, got {_kind(value)}")
        types_, required = _fields(tp)
        unknown = value.keys() - types_.keys()
        if unknown:
            raise InvalidMessage(f"{where} has unknown fields {sorted(map(repr, unknown))}")
        missing = required - value.keys()
        if missing:
            raise InvalidMessage(f"{where} lacks fields {sorted(missing)}")
        kwargs = {name: _build(types_[name], v, f"{where}.{name}") for name, v in value.items()}
        try:
            return tp(**kwargs)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"{where}: {e}") from None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and types.NoneType in args:
            return None
        (tp,) = (a for a in args if a is not types.NoneType)  # only `X | None` is used on the wire
        return _build(tp, value, where)
    if origin is list:
        if type(value) is not list:
            raise InvalidMessage(f"{where} must be an array, got {_kind(value)}")
        (elem,) = typing.get_args(tp)
        if elem is int:
            if not all(type(v) is int and v in _INT64 for v in value):
                raise InvalidMessage(f"{where} must hold 64-bit integers only")
            return value
        if elem in _SCALARS and all(type(v) is elem for v in value):
            return value  # a chain's keys in one pass; a bad element is named by the loop below
        return [_build(elem, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is int:
        if type(value) is not int or value not in _INT64:
            raise InvalidMessage(f"{where} must be a 64-bit integer, got {_kind(value)}")
        return value
    if tp is float:
        if type(value) not in (float, int):
            raise InvalidMessage(f"{where} must be a number, got {_kind(value)}")
        return float(value)
    if tp in _SCALARS:
        if type(value) is not tp:
            raise InvalidMessage(f"{where} must be {tp.__name__}, got {_kind(value)}")
        return value
    raise TypeError(f"the codec cannot decode {tp!r}")  # a message declared with an unsupported type
