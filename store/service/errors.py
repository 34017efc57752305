"""The one table between the engine's exceptions and the service's ERROR codes, for both ends.

The server turns an exception into an ERROR reply (`error_reply`); the client turns the reply
back into the exception the engine would have raised (`exception_from`).  Both read the same
rows, so a code cannot be sent that the other end maps to something else.  Rows are tried in
order: a subclass comes before its base (DamagedPayload before CorruptRecord, StoreFailed
before StoreError).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from store.errors import (
    CorruptRecord,
    DamagedPayload,
    ParentConflict,
    PayloadTooLarge,
    StoreClosed,
    StoreError,
    StoreFailed,
    TurnNotInContext,
    UnknownBlob,
    UnknownContext,
    UnknownTurn,
)
from store.service import messages as m
from store.service.frames import SERVICE_ERRORS, ErrorCode, ServiceError


@dataclass(frozen=True, slots=True)
class _Row:
    exc: type[StoreError]
    code: ErrorCode
    to_reply: Callable[[Any], tuple[str, int, int]]
    """message, arg0, arg1 of the ERROR for an exception of this row."""
    from_reply: Callable[[m.ErrorReply, Any], StoreError]
    """The exception again, from the ERROR and the request it answers (for what it omits)."""


_DAMAGED = re.compile(r"payload blob ([0-9a-f]{64}) is damaged: (.*)", re.DOTALL)


def _damaged_payload(err: m.ErrorReply) -> DamagedPayload:
    """arg0 is the turn; the message names the blob (as DamagedPayload's own text does)."""
    found = _DAMAGED.search(err.message)
    if found is None:
        return DamagedPayload(err.arg0, b"", err.message)
    return DamagedPayload(err.arg0, bytes.fromhex(found.group(1)), found.group(2))


_ROWS: tuple[_Row, ...] = (
    _Row(UnknownContext, ErrorCode.UNKNOWN_CONTEXT,
         lambda x: (str(x), x.context_id, 0), lambda e, r: UnknownContext(e.arg0)),
    _Row(UnknownTurn, ErrorCode.UNKNOWN_TURN,
         lambda x: (str(x), x.turn_id, 0), lambda e, r: UnknownTurn(e.arg0)),
    _Row(UnknownBlob, ErrorCode.UNKNOWN_BLOB,
         lambda x: (str(x), 0, 0), lambda e, r: UnknownBlob(getattr(r, "blob_hash", b""))),
    _Row(ParentConflict, ErrorCode.PARENT_CONFLICT,
         lambda x: (str(x), x.expected, x.actual),
         lambda e, r: ParentConflict(getattr(r, "context_id", 0), e.arg0, e.arg1)),
    _Row(PayloadTooLarge, ErrorCode.PAYLOAD_TOO_LARGE,
         lambda x: (str(x), x.size, x.limit), lambda e, r: PayloadTooLarge(e.arg0, e.arg1)),
    _Row(DamagedPayload, ErrorCode.DAMAGED_PAYLOAD,
         lambda x: (str(x), x.turn_id, 0), lambda e, r: _damaged_payload(e)),
    _Row(CorruptRecord, ErrorCode.CORRUPT,  # offset -1: no record to point at
         lambda x: (str(x), max(x.offset, 0), 0),
         lambda e, r: CorruptRecord("store service", e.arg0, e.message)),
    _Row(TurnNotInContext, ErrorCode.TURN_NOT_IN_CONTEXT,
         lambda x: (str(x), x.context_id, x.turn_id), lambda e, r: TurnNotInContext(e.arg0, e.arg1)),
    _Row(StoreClosed, ErrorCode.STORE_CLOSED, lambda x: (str(x), 0, 0), lambda e, r: StoreClosed()),
    _Row(StoreFailed, ErrorCode.STORE_FAILED,
         lambda x: (x.reason, x.errno, 0),
         lambda e, r: StoreFailed.make("behind the service", e.message, e.arg0)),
    _Row(StoreError, ErrorCode.STORE_ERROR,
         lambda x: (f"{type(x).__name__}: {x}", 0, 0), lambda e, r: StoreError(e.message)),
)  # fmt: skip
_BY_CODE: dict[int, _Row] = {row.code: row for row in _ROWS}


def error_reply(exc: BaseException) -> m.ErrorReply:
    """The ERROR for an exception: its code, the numbers the code carries, its message."""
    if isinstance(exc, ServiceError):
        return m.ErrorReply(exc.code, str(exc), exc.arg0, exc.arg1)
    for row in _ROWS:
        if isinstance(exc, row.exc):
            return m.ErrorReply(row.code, *row.to_reply(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return m.ErrorReply(ErrorCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
    return m.ErrorReply(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")


def exception_from(err: m.ErrorReply, req: m.Request | None, req_id: int) -> StoreError:
    """The exception an ERROR reply stands for (the request supplies what the reply omits)."""
    row = _BY_CODE.get(err.code)
    if row is not None and req is not None:
        return row.from_reply(err, req)
    cls = SERVICE_ERRORS.get(err.code, ServiceError)
    text = err.message if cls is not ServiceError else f"{err.code_name()}: {err.message}"
    return cls(text, req_id, err.arg0, err.arg1)
