"""Zero-copy spills for the Python binding: the layers' buffers go to
kvt_tier_spill_nocopy and stay referenced here until the C writer releases
them.

One ``Holds`` per tier.  ``spill`` decides per spill (see _convert's hold
mode): when at least one tensor's buffer is frozen (nobody can change it
before it is written), the shared ones are copied on the caller's thread and
the whole keep-alive list is handed over; when none is, the spill takes the
copying kvt_tier_spill road as before.  What is held counts against
``spill_queue_bytes`` from the call until the release - the spill being
written and, with a remote tier, the upload too, which the C queue no longer
counts - and a spill that would pass the bound is refused as a full queue
(never waited for).

Threads: the release callback runs on the C writer thread (or the remote
upload thread, or the spilling thread itself when the call fails).  It is a
ctypes callback, so it takes the GIL; libkvtier calls it with none of its
locks held, and every binding call into libkvtier releases the GIL (ctypes
CDLL), so neither side waits for the other while holding what the other
needs.  It does one dict pop (atomic under the GIL) and takes no Python lock,
so it cannot deadlock with a spilling or closing thread.  The callback and
the dict live as long as the tier's handle (its ``keep`` list, cleared only
after kvt_tier_free has joined the writer), so no release can arrive after
them; a tier still open at interpreter exit is freed by its finalizer at
exit, while threads can still take the GIL.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, Tuple

from . import _lib as L
from ._convert import _Keep

class Holds:
    """The buffers of a tier's zero-copy spills, until written.

    ``spills_nocopy`` / ``spills_copied`` count the spills accepted on each
    road, ``copied_bytes`` the bytes copied in Python for shared tensors of a
    zero-copy spill, ``refused_held`` the spills refused because the held
    bytes would pass the bound."""

    def __init__(self, queue_bytes: int) -> None:
        self.queue_bytes = int(queue_bytes)
        self._held: Dict[int, Tuple[_Keep, int]] = {}
        self._ids = itertools.count(1)
        self.spills_nocopy = 0
        self.spills_copied = 0
        self.copied_bytes = 0
        self.refused_held = 0
        # Counters and the bound's check; never taken by _release (which may
        # run on this very thread inside the libkvtier call), nor held
        # across a libkvtier call.
        self._count_lock = threading.Lock()
        self.release_fn = L.RELEASE_CTX_FN(self._release)

    def _release(self, ctx: Any) -> None:
        # Any thread, GIL held by ctypes.  Dropping the list drops the
        # references (MLX arrays, numpy arrays, pins) the writer was reading.
        self._held.pop(int(ctx or 0), None)

    def held_bytes(self) -> int:
        """Bytes held for spills not yet released."""
        return sum(n for _k, n in list(self._held.values()))

    def pending(self) -> int:
        """Zero-copy spills not yet released."""
        return len(self._held)

    def spill(self, tier_ptr: int, tok: Any, n: int, layers: Any, nl: int,
              memory_bytes: int, co: Any, keep: _Keep,
              copy_call: Callable[[], int]) -> Tuple[int, bool]:
        """Spills layers (built with build_layers(..., hold=True)): zero-copy
        when some buffer is frozen, else through copy_call() (the copying
        spill).  Returns (0 or a KVT_E* code, counted): counted is False for
        the refusal decided here - KVT_EFULL, the held bytes would pass the
        bound - which the caller counts; libkvtier counts its own."""
        if keep.frozen_bytes == 0:
            rc = copy_call()
            if rc == 0:
                with self._count_lock:
                    self.spills_copied += 1
            return rc, True
        total = keep.held_bytes
        qb = self.queue_bytes
        # A spill larger than the bound on its own is libkvtier's refusal
        # (KVT_ETOOBIG); one that fits alone but not beside what is held is
        # a full queue, decided here.
        key = next(self._ids)
        with self._count_lock:  # check and insert as one step among spillers
            if qb and total <= qb and self.held_bytes() + total > qb:
                self.refused_held += 1
                return L.KVT_EFULL, False
            self._held[key] = (keep, total)
        try:
            copied = keep.unshared()  # total already counts these bytes
        except BaseException:
            self._held.pop(key, None)
            raise
        rc = L.kvt_tier_spill_nocopy_ex(tier_ptr, tok, n, layers, nl, int(memory_bytes),
                                        self.release_fn, key, co)
        # On failure libkvtier ran the release before returning.
        if rc == 0:
            with self._count_lock:
                self.spills_nocopy += 1
                self.copied_bytes += copied
        else:
            self._held.pop(key, None)
        return rc, True

    def refusal_message(self, total: int) -> str:
        """The text of a refusal decided here (libkvtier's wording)."""
        return (f"spill queue full: {self.held_bytes()} bytes held for spills not yet "
                f"written + {total} > spill_queue_bytes ({self.queue_bytes}); entry dropped")

    def stats(self) -> dict:
        """The counters above and the held gauges, for get_stats()."""
        return {"spill_nocopy": self.spills_nocopy, "spill_copied": self.spills_copied,
                "spill_nocopy_copied_bytes": self.copied_bytes,
                "spill_held": self.pending(), "spill_held_bytes": self.held_bytes(),
                "spill_refused_held": self.refused_held}
