"""`Touch` of an engine's own prefix-cache hits, shared by the integrations (docs/client-protocol.md).

Pages an engine serves from its GPU (or host) prefix cache are never fetched from kvnode, so
without a touch the daemon's DRAM policy sees the hottest prefixes as cold and evicts them
first. Each integration, where its engine tells it which leading pages it already holds, sends
one `Touch` of those pages' keys (the daemon refreshes the leading run it holds in DRAM):

    vLLM connector   get_num_new_matched_tokens: pages [0, num_computed_tokens), on the lookup
                     thread, once per scheduling of a request (kvnode.vllm.lookup)
    vLLM tier        SecondaryTierManager.touch(keys) when vLLM calls it (0.33 never does)
    SGLang backend   batch_exists / batch_exists_v2: `extra_info.prefix_keys`, the pages the
                     radix tree matched on device and host (needs SGLang's extra-config
                     `hicache_storage_pass_prefix_keys: true`)

A touch is an optimisation: it never fails or delays the request. At most `MAX_TOUCH_KEYS`
leading keys go in one touch; a refusal or a dead daemon is logged at debug and counted.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Sequence

from kvnode.wire import Connection, KvnodeError

#: Most keys one touch sends: the leading ones (every request shares a prefix's first pages,
#: so they matter most). 8192 keys are about 300 KiB of request header, well under the
#: daemon's 16 MiB frame limit, and one pass over its DRAM index under one lock.
MAX_TOUCH_KEYS = 8192


class TouchLog:
    """Sends touches and counts them (thread-safe; `totals` reads the counters).

    touches       touches the daemon answered
    touched_keys  keys the daemon found in DRAM and refreshed (the `Touched` counts)
    touch_errors  touches refused (e.g. a namespace this tenant does not own) or that did not
                  reach the daemon; each is logged at debug, never raised into the request
    """

    def __init__(self, logger: logging.Logger):
        self._log = logger
        self._lock = threading.Lock()
        self._v: Dict[str, int] = {"touches": 0, "touched_keys": 0, "touch_errors": 0}

    def send(self, conn: Connection, ns: int, keys: Sequence[list]) -> Optional[int]:
        """Touches the leading `MAX_TOUCH_KEYS` of `keys` in `ns`: the daemon's count, or None
        when it refused (logged at debug, counted). An OSError (the connection broke) is
        counted, logged at debug and raised again: the connection's owner drops it."""
        keys = list(keys[:MAX_TOUCH_KEYS])
        if not keys:
            return 0
        try:
            n = conn.touch(ns, keys)
        except KvnodeError as e:
            self._count(touch_errors=1)
            self._log.debug("kvnode touch of %d keys in namespace %d refused: %s", len(keys), ns, e)
            return None
        except OSError as e:
            self._count(touch_errors=1)
            self._log.debug("kvnode touch of %d keys did not reach the daemon: %s", len(keys), e)
            raise
        self._count(touches=1, touched_keys=n)
        return n

    def failed(self, why: BaseException) -> None:
        """A touch that could not even be sent (no connection): counted, logged at debug."""
        self._count(touch_errors=1)
        self._log.debug("kvnode touch not sent: %s", why)

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._v[k] += v

    def totals(self) -> Dict[str, int]:
        """The counters since the start (not reset)."""
        with self._lock:
            return dict(self._v)


def leading_keys(digests: Sequence[bytes], nseg: int) -> List[list]:
    """Protocol keys of whole pages, page by page, every segment, capped at MAX_TOUCH_KEYS."""
    pages = -(-MAX_TOUCH_KEYS // max(1, nseg))
    return [[d, s] for d in digests[:pages] for s in range(nseg)][:MAX_TOUCH_KEYS]
