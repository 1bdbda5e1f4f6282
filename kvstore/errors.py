"""Exceptions of the kvstore: one class per protocol ErrorCode, plus the client-side DaemonUnavailable.

The daemon raises them and answers with their code; the client turns an error reply back into the same class.
"""

from __future__ import annotations

from .protocol import ErrorCode


class KVStoreError(Exception):
    code: ErrorCode | None = None


class ProtocolError(KVStoreError):
    code = ErrorCode.MALFORMED


class VersionMismatch(ProtocolError):
    code = ErrorCode.VERSION_MISMATCH


class UnknownOpcode(ProtocolError):
    code = ErrorCode.UNKNOWN_OPCODE


class MessageTooLarge(ProtocolError):
    code = ErrorCode.MESSAGE_TOO_LARGE


class InvalidMessage(ProtocolError):
    code = ErrorCode.INVALID_MESSAGE


class InvalidArgument(KVStoreError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class Unauthorized(KVStoreError, PermissionError):
    code = ErrorCode.UNAUTHORIZED


class SessionExpired(KVStoreError):
    code = ErrorCode.UNKNOWN_SESSION


class ClientIdInUse(KVStoreError):
    code = ErrorCode.CLIENT_ID_IN_USE


class ArenaFull(KVStoreError):
    code = ErrorCode.ARENA_FULL


class BudgetExceeded(KVStoreError):
    code = ErrorCode.BUDGET_EXCEEDED


class HostMemoryExhausted(KVStoreError):
    code = ErrorCode.HOST_MEMORY


class ArenaNotReady(KVStoreError):
    code = ErrorCode.ARENA_NOT_READY


class ArenaFailed(KVStoreError):
    code = ErrorCode.ARENA_FAILED


class LimitExceeded(KVStoreError):
    code = ErrorCode.LIMIT_EXCEEDED


class ShuttingDown(KVStoreError):
    code = ErrorCode.SHUTTING_DOWN


class InternalError(KVStoreError):
    code = ErrorCode.INTERNAL


class DaemonUnavailable(KVStoreError, TimeoutError):
    """No answer from the daemon within the timeout: it is not running, crashed, or is unreachable."""


class EndpointInUse(KVStoreError, OSError):
    """Another daemon already listens on the endpoint."""


class StateRejected(KVStoreError):
    """A starting daemon found its endpoint's journal and arenas but cannot re-adopt them as they are."""


ERROR_TYPES: dict[ErrorCode, type[KVStoreError]] = {
    cls.code: cls for cls in KVStoreError.__subclasses__() + ProtocolError.__subclasses__() if cls.code is not None
}
if set(ERROR_TYPES) != set(ErrorCode):
    raise RuntimeError(f"no exception class for {sorted(c.name for c in set(ErrorCode) - set(ERROR_TYPES))}")


def error_from_reply(code: int, message: str) -> KVStoreError:
    try:
        return ERROR_TYPES[ErrorCode(code)](message)
    except ValueError:  # a code from a newer daemon
        return KVStoreError(f"[error {code}] {message}")
