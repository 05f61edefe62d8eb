"""Per-key outcomes, mirrored from the daemon (docs/client-protocol.md): of a store (`PutStatus`,
`CommitStatus`) and of a hinted operation (`KeyOutcome`, `FailCode`).

A store answers one `PutStatus` per key (Put, PutFromRegion, Offload, an Alloc's refusal) and
one `CommitStatus` per handle of a Commit; `stored` and `committed` say whether the block is in
the daemon now (stored by this call or already there: blocks are immutable).

A per-key outcome in an ``OpReport`` is the string ``"HitLocal"``, ``"Pulled"``, ``"Pending"``
or ``"Missed"``, or a map ``{"Failed": {"code": <FailCode name>, "message": str}}``; the
report's ``reason`` is ``None`` or such a failure map. Act on ``code``; ``message`` is for
people and may change.
"""

import enum
from typing import Any, Optional, Tuple


class FailCode(str, enum.Enum):
    """Why a key, or a whole op, failed (kvnode_proto::pull::FailCode)."""

    MALFORMED_HINT = "MalformedHint"
    NOT_AUTHORIZED = "NotAuthorized"
    NOT_COVERED = "NotCovered"
    PEER_UNREACHABLE = "PeerUnreachable"
    PEER_BUSY = "PeerBusy"
    PEER_REFUSED = "PeerRefused"
    PEER_FAILED = "PeerFailed"
    DEADLINE = "Deadline"
    CANCELLED = "Cancelled"
    CHECKSUM = "Checksum"
    LOCAL_STORE = "LocalStore"

    @classmethod
    def parse(cls, name: Any) -> "FailCode":
        """The code named ``name``; an unknown (newer) code reads as ``PEER_FAILED``."""
        try:
            return cls(name)
        except ValueError:
            return cls.PEER_FAILED


USABLE = ("HitLocal", "Pulled")
#: PutStatus values after which the block is in the daemon (kvnode_proto::client::PutStatus).
PUT_OK = frozenset({"Stored", "Exists"})
#: CommitStatus values after which the block is in the daemon (kvnode_proto::client::CommitStatus).
COMMIT_OK = frozenset({"Committed", "Duplicate"})


def stored(status: Any) -> bool:
    """Whether a PutStatus means the block is in the daemon now (new or already present)."""
    return status in PUT_OK


def committed(status: Any) -> bool:
    """Whether a CommitStatus means the block is in the daemon now (ours or a racing writer's)."""
    return status in COMMIT_OK


def failure_of(value: Any) -> Optional[Tuple[FailCode, str]]:
    """``(code, message)`` of a failed outcome or an op's ``reason``; ``None`` otherwise."""
    if isinstance(value, dict) and "Failed" in value:
        value = value["Failed"]
    if isinstance(value, dict) and "code" in value:
        return FailCode.parse(value["code"]), str(value.get("message", ""))
    return None


def usable(outcome: Any) -> bool:
    """Whether a per-key outcome means the block is on this node now."""
    return outcome in USABLE
