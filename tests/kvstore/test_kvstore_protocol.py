"""The wire protocol and its codec, in process."""

from __future__ import annotations

import msgpack
import pytest

from freekv_kvstore import codec, protocol
from freekv_kvstore.arena import ArenaGeometry
from freekv_kvstore.errors import (
    ERROR_TYPES,
    InvalidArgument,
    InvalidMessage,
    KVStoreError,
    MessageTooLarge,
    ProtocolError,
    VersionMismatch,
    error_from_reply,
)
from freekv_kvstore.protocol import ErrorCode, Opcode

pytestmark = pytest.mark.timeout(60)

GEOM = ArenaGeometry(num_layers=30, num_kv_heads=3, page_size=32, head_dim=64, dtype="bfloat16")
ARENA_STATS = protocol.ArenaStats("rank0", 0, True, True, "/dev/shm/x", 8, 1024, 5, 2, 1, 1, 1, 0, 0.5)
SAMPLES = [
    protocol.HelloRequest("rank0", GEOM, 4096, rank=1, token="t", pid=12, hostname="h", proc_start=1.5),
    protocol.HelloReply(7, "rank0", "/dev/shm/x", 4096 * GEOM.page_bytes, 4096, GEOM.page_bytes,
                        list(GEOM.shape(4096)), "bfloat16", True, False, 0, 1.0, 3.0, 99),  # fmt: skip
    protocol.ByeRequest(),
    protocol.ByeReply(3),
    protocol.HeartbeatRequest(),
    protocol.HeartbeatReply(True),
    protocol.AllocRequest([1, 2**63 - 1, -5], [3, 0, 1]),
    protocol.AllocReply([[0, 1, 2], [], [3]]),
    protocol.FreeRequest([1, 2]),
    protocol.FreeReply([3, 1], [2, 0]),
    protocol.RetainRequest([b"k" * 16, b"\x00"], [[1, 2], [3]]),
    protocol.RetainReply([[1, 2], [3]], [True, False]),
    protocol.ReleaseRequest([b"k" * 16]),
    protocol.ReleaseReply([True], 2),
    protocol.LookupRequest([b"a", b"b"], request_id=5),
    protocol.LookupReply(1, [4, 5]),
    protocol.StatsRequest(token=None, check=True),
    protocol.StatsReply(1, 1, "ipc:///x", 2.0, 1 << 30, 1 << 20, 1, 10, 2, 0, [ARENA_STATS], True, None),
    protocol.PingRequest("t"),
    protocol.PingReply(1, 0.5),
    protocol.RetainChainRequest([b"k0", b"k1"], [3, 4], parent=b"p"),
    protocol.RetainChainReply([True, False]),
    protocol.ShutdownRequest(),
    protocol.ShutdownReply(0),
    protocol.ErrorReply(int(ErrorCode.ARENA_FULL), "no room"),
]


def test_wire_values_are_pinned():
    """Values on the wire never change: renumbering breaks every daemon and client of another checkout."""
    assert {op.name: int(op) for op in Opcode} == {
        "HELLO": 0x01, "BYE": 0x02, "HEARTBEAT": 0x03, "ALLOC": 0x10, "FREE": 0x11, "RETAIN": 0x20,
        "RELEASE": 0x21, "LOOKUP": 0x22, "RETAIN_CHAIN": 0x23, "STATS": 0x30, "PING": 0x31, "SHUTDOWN": 0x3F,
    }  # fmt: skip
    assert [(c.name, int(c)) for c in ErrorCode] == [
        ("MALFORMED", 1), ("VERSION_MISMATCH", 2), ("UNKNOWN_OPCODE", 3), ("MESSAGE_TOO_LARGE", 4),
        ("INVALID_MESSAGE", 5), ("INVALID_ARGUMENT", 6), ("UNAUTHORIZED", 7), ("UNKNOWN_SESSION", 8),
        ("CLIENT_ID_IN_USE", 9), ("ARENA_FULL", 10), ("BUDGET_EXCEEDED", 11), ("HOST_MEMORY", 12),
        ("ARENA_NOT_READY", 13), ("ARENA_FAILED", 14), ("LIMIT_EXCEEDED", 15), ("SHUTTING_DOWN", 16),
        ("INTERNAL", 17),
    ]  # fmt: skip
    assert protocol.REQUEST_HEADER.size == 16 and protocol.REPLY_HEADER.size == 9


def test_every_opcode_has_messages_and_every_error_code_an_exception():
    assert set(protocol.MESSAGES) == set(Opcode)
    assert set(ERROR_TYPES) == set(ErrorCode)
    assert all(cls.code is code for code, cls in ERROR_TYPES.items())
    sampled = {type(m) for m in SAMPLES}
    for spec in protocol.MESSAGES.values():
        assert spec.request in sampled and spec.reply in sampled


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert codec.decode(type(msg), codec.encode(msg)) == msg


def test_frames_round_trip():
    frames = codec.request_frames(Opcode.ALLOC, 42, 7, protocol.AllocRequest([1], [2]))
    assert codec.parse_request_header(frames[0]) == (protocol.PROTOCOL_VERSION, Opcode.ALLOC, 42, 7)
    op, status, call_id, body = codec.parse_reply(codec.reply_frames(Opcode.ALLOC, 42, protocol.AllocReply([[0, 1]])))
    assert (op, status, call_id) == (Opcode.ALLOC, protocol.Status.OK, 42)
    assert codec.decode(protocol.AllocReply, body).pages == [[0, 1]]
    op, status, call_id, body = codec.parse_reply(codec.error_frames(0x77, 3, ErrorCode.UNKNOWN_OPCODE, "x" * 5000))
    assert status is protocol.Status.ERROR and call_id == 3
    assert len(codec.decode(protocol.ErrorReply, body).message) == 2000  # error text is capped


def _body(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    "cls, body, error, match",
    [
        (protocol.AllocRequest, _body(request_ids=[1], counts=["2"]), InvalidMessage, "64-bit integers"),
        (protocol.AllocRequest, _body(request_ids=[True], counts=[2]), InvalidMessage, "64-bit integers"),
        (protocol.AllocRequest, _body(request_ids=[2**63], counts=[2]), InvalidMessage, "64-bit integers"),
        (protocol.AllocRequest, _body(request_ids=[1], counts=[1], extra=1), InvalidMessage, "unknown fields"),
        (protocol.AllocRequest, _body(request_ids=[1]), InvalidMessage, "lacks fields"),
        (protocol.AllocRequest, _body(request_ids=1, counts=[1]), InvalidMessage, "must be an array"),
        (protocol.AllocRequest, msgpack.packb([1, 2]), InvalidMessage, "must be a map"),
        (protocol.AllocRequest, _body(request_ids=[1, 2], counts=[1]), InvalidArgument, "counts"),
        (protocol.AllocRequest, _body(request_ids=[1], counts=[-1]), InvalidArgument, ">= 0"),
        (protocol.RetainRequest, _body(keys=["text"], pages=[[1]]), InvalidMessage, "must be bytes"),
        (protocol.RetainRequest, _body(keys=[b""], pages=[[1]]), InvalidArgument, "1..64 bytes"),
        # A chain's keys are checked in one pass; the first that is not bytes is named.
        (protocol.RetainChainRequest, _body(keys=[b"a", b"b", 7, b"d"], pages=[1, 2, 3, 4]), InvalidMessage,
         r"keys\[2\] must be bytes"),
        (protocol.LookupRequest, _body(keys=[b"k"], request_id=1.5), InvalidMessage, "64-bit integer"),
        (protocol.StatsRequest, _body(check=1), InvalidMessage, "must be bool"),
        (protocol.PingRequest, msgpack.packb({1: 2}, strict_types=False), ProtocolError, "not one valid msgpack"),
        (protocol.PingRequest, msgpack.packb({}) + b"\x00", ProtocolError, "not one valid msgpack"),
        (protocol.PingRequest, b"\xc1", ProtocolError, "not one valid msgpack"),
        (protocol.PingRequest, b"\x91" * 5000, ProtocolError, "not one valid msgpack"),
        (protocol.PingRequest, b"\x80" + b"\x00" * protocol.MAX_BODY_BYTES, MessageTooLarge, "exceeds"),
        (protocol.HelloRequest, _body(client_id="a", num_pages=1, geometry=dict(num_layers=1, num_kv_heads=1,
            page_size=1, head_dim=1, dtype="int8")), InvalidArgument, "dtype"),  # fmt: skip
        (protocol.HelloRequest, _body(client_id="a\n", num_pages=1, geometry=dict(num_layers=1, num_kv_heads=1,
            page_size=1, head_dim=1)), InvalidArgument, "printable"),  # fmt: skip
    ],
)
def test_decode_refuses_bad_bodies_with_typed_errors(cls, body, error, match):
    with pytest.raises(error, match=match):
        codec.decode(cls, body)


def test_headers_refuse_junk():
    with pytest.raises(ProtocolError, match="16 bytes"):
        codec.parse_request_header(b"FK\x01")
    with pytest.raises(ProtocolError, match="not a kvstore client"):
        codec.parse_request_header(b"XX" + b"\x00" * 14)
    with pytest.raises(ProtocolError):
        codec.parse_reply([b"FK"])
    newer = [protocol.REPLY_HEADER.pack(b"FK", 99, 1, 0, 1), b"\x80"]
    with pytest.raises(VersionMismatch, match="protocol 99"):
        codec.parse_reply(newer)


def test_error_replies_become_their_exception_class():
    err = error_from_reply(int(ErrorCode.ARENA_FULL), "no room")
    assert type(err).__name__ == "ArenaFull" and str(err) == "no room" and err.code is ErrorCode.ARENA_FULL
    unknown = error_from_reply(999, "from the future")
    assert type(unknown) is KVStoreError and "999" in str(unknown)


def test_geometry_validates_and_normalizes():
    g = ArenaGeometry(2, 3, 4, 8, "torch.float16")
    assert g.dtype == "float16" and g.page_bytes == 2 * 3 * 2 * 4 * 8 * 2 and g.shape(5) == (5, 2, 3, 2, 4, 8)
    assert ArenaGeometry(1, 1, 1, 1, "bf16").dtype == "bfloat16"
    for bad in ({"num_layers": 0}, {"head_dim": True}, {"page_size": 2.0}, {"dtype": "int8"}, {"num_layers": 1 << 20}):
        with pytest.raises(ValueError):
            ArenaGeometry(**{**dict(num_layers=1, num_kv_heads=1, page_size=1, head_dim=1), **bad})
