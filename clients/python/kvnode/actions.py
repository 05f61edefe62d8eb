"""Sending a request's router actions to the daemon (`Act`), once, and surfacing the answers.

The three engine seams share this: `kvnode.hints.split_envelope` says which actions go when;
`ActionLog` remembers what each envelope already sent (per namespace and phase, by key, so a
request whose keys arrive in several calls sends each key once and a repeated call sends
nothing), logs every refused action at warning with its id and type, and counts:

    actions_sent      actions delivered in an `Act` (each action once per envelope and phase)
    actions_refused   actions the daemon refused (`Refused`), or that never reached it (the
                      daemon down, the envelope refused whole); each once per envelope and phase

`ActionSender` is a background thread with its own connection, for seams whose engine calls
must not wait on a socket (vLLM's scheduler thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from kvnode.hints import RequestActions
from kvnode.wire import ActionResult, Connection, KvnodeError, act

logger = logging.getLogger("kvnode.actions")

#: Envelopes remembered for deduplication; the oldest is forgotten beyond this.
MAX_ENVELOPES = 4096
NOW = "now"
COMPLETION = "completion"
#: A seam with no request-completion point sends every action at once (RequestActions.unplaced_text).
UNPLACED = "unplaced"


@dataclass
class _Sent:
    keys: Set[Tuple[bytes, int]] = field(default_factory=set)
    counted: Set[str] = field(default_factory=set)  # action ids counted as sent / refused


class ActionLog:
    """Which keys of which envelope were sent, and the counters (thread-safe)."""

    def __init__(self, log: logging.Logger = logger):
        self._lock = threading.Lock()
        self._sent: "OrderedDict[tuple, _Sent]" = OrderedDict()
        self.counts: Dict[str, int] = {"actions_sent": 0, "actions_refused": 0}
        self._log = log

    def claim(self, acts: RequestActions, phase: str, scope: object, keys: Sequence[list]
              ) -> Optional[List[list]]:
        """The `keys` this envelope has not yet been sent with (in `scope`: a namespace, for
        `phase`), now marked sent; None when there is nothing to send (every key was sent
        already). The first claim is never None, even without keys, so every action reaches
        the daemon at least once and is answered."""
        with self._lock:
            at = (acts.key, phase, scope)
            first = at not in self._sent
            entry = self._entry(at)
            new = [k for k in keys if (bytes(k[0]), int(k[1])) not in entry.keys]
            entry.keys.update((bytes(k[0]), int(k[1])) for k in new)
            return new if new or first else None

    def _entry(self, at: tuple) -> _Sent:
        entry = self._sent.get(at)
        if entry is None:
            entry = self._sent[at] = _Sent()
            while len(self._sent) > MAX_ENVELOPES:
                self._sent.popitem(last=False)
        else:
            self._sent.move_to_end(at)
        return entry

    def _first(self, acts: RequestActions, phase: str, scope: object, action_id: str) -> bool:
        with self._lock:
            entry = self._entry((acts.key, phase, scope))
            if action_id in entry.counted:
                return False
            entry.counted.add(action_id)
            return True

    def send(self, conn: Connection, ns: int, keys: Sequence[list], acts: RequestActions,
             phase: str, text: Optional[str], scope: object = None) -> List[ActionResult]:
        """`Act` in `ns` with the envelope `text` on the claimed `keys`; logs and counts the
        answers (each action once per envelope, phase and `scope`, by default `ns`). A daemon
        that refuses the envelope or fails counts every action refused; the error (KvnodeError /
        OSError) is raised for the caller's connection handling."""
        if text is None:
            return []
        scope = ns if scope is None else scope
        try:
            message_id, results = act(conn, ns, list(keys), text)
        except (KvnodeError, OSError) as e:
            self.undelivered(acts, phase, scope, e)
            raise
        for i, r in enumerate(results):
            ident = r.action_id or f"#{i}"
            if not self._first(acts, phase, scope, f"sent:{ident}"):
                continue
            with self._lock:
                self.counts["actions_sent"] += 1
            if r.refused and self._first(acts, phase, scope, f"refused:{ident}"):
                with self._lock:
                    self.counts["actions_refused"] += 1
                self._log.warning("kvnode: router action %r (%s) of envelope %r refused (%s): %s",
                                  r.action_id, r.action_type, message_id, r.code, r.message)
        return results

    def undelivered(self, acts: RequestActions, phase: str, scope: object, why: Exception) -> None:
        """The envelope's actions of `phase` did not execute (`why`): logged, and counted
        refused once per envelope and phase."""
        self._log.warning("kvnode: router actions of envelope %r (%s) not executed: %s",
                          acts.message_id, phase, why)
        if self._first(acts, phase, scope, "undelivered"):
            with self._lock:
                self.counts["actions_refused"] += _count(acts, phase)

    def take(self) -> Dict[str, int]:
        """The counters (monotonic totals)."""
        with self._lock:
            return dict(self.counts)


def _count(acts: RequestActions, phase: str) -> int:
    return {NOW: len(acts.now), COMPLETION: len(acts.at_completion)}.get(
        phase, len(acts.now) + len(acts.at_completion))


@dataclass
class _Job:
    keys: List[list]
    acts: RequestActions
    phase: str
    text: Optional[str]
    scope: object = None


@dataclass
class _TouchJob:
    keys: List[list]
    log: Any  # kvnode.touch.TouchLog: sends, counts and logs the touch


class ActionSender:
    """Sends `Act`s (and `Touch`es, `submit_touch`) from a queue on one background thread with
    its own daemon connection."""

    def __init__(self, connect: Callable[[], Connection], register: Callable[[Connection], int],
                 log: ActionLog, name: str = "kvnode-actions"):
        self._connect, self._register, self.log = connect, register, log
        self._conn: Optional[Connection] = None
        self._ns = 0
        self._q: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, keys: Optional[Sequence[list]], acts: RequestActions, phase: str,
               text: Optional[str], scope: object = None) -> None:
        """Queues one `Act` (returns at once); `keys` are those `ActionLog.claim` returned for
        `scope`."""
        if text is None or keys is None:
            return
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put(_Job(list(keys), acts, phase, text, scope))

    def submit_touch(self, keys: Sequence[list], log: Any) -> None:
        """Queues one `Touch` of `keys` (returns at once); `log` is the kvnode.touch.TouchLog
        that sends, counts and logs it (a failure is never raised)."""
        if not keys:
            return
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put(_TouchJob(list(keys), log))  # type: ignore[arg-type]

    def drain(self, timeout: float = 10.0) -> bool:
        """Waits until every queued `Act` was answered; False on timeout."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _open(self) -> Connection:
        if self._conn is None:
            conn = self._connect()
            try:
                self._ns = self._register(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                try:
                    conn = self._open()
                except (KvnodeError, OSError) as e:
                    if isinstance(job, _TouchJob):
                        job.log.failed(e)
                    else:
                        self.log.undelivered(job.acts, job.phase, job.scope, e)
                    continue
                if isinstance(job, _TouchJob):
                    job.log.send(conn, self._ns, job.keys)  # an OSError drops the connection below
                    continue
                self.log.send(conn, self._ns, job.keys, job.acts, job.phase, job.text, job.scope)
            except (KvnodeError, OSError):
                # Logged and counted by ActionLog.send; reconnect for the next job.
                if self._conn is not None:
                    try:
                        self._conn.close()
                    except OSError:
                        pass
                    self._conn = None
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()
