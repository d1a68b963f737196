"""The promote budget and the awaited promise, shared by the two front ends
(``kvtier.ssd_cache`` and ``kvtier.Tier``).

``Budget`` turns the caller's reserve and release functions into the C
callbacks of a kvt_promote_opts.  libkvtier calls them on the thread that
starts the promote (reserve, and release when the promote fails there) or
that collects, cancels or frees its promise (release), never on a worker,
so an exception from reserve is kept in ``exc`` for that thread to raise.
The Budget must stay alive until the promise is freed: the release callback
may run then.

``settle`` awaits an async promote's promise without blocking the event
loop: on the promise's file descriptor through the loop's add_reader, or,
when there is no descriptor or the loop cannot watch one, by polling with a
growing sleep.  Whatever happens the promise is freed exactly once: after
the result was handed to the caller's ``finish``, or, when the await itself
ends in an exception (a cancelled task, a closing loop), after
kvt_promise_cancel has stopped the read and released the reservation on
this thread.
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any, Callable, Optional, TypeVar

from . import _lib as L

T = TypeVar("T")


class Budget:
    """The C callbacks around reserve(nbytes) -> bool and release(nbytes).

    Either function may be None: without reserve nothing is asked before
    the read; libkvtier wants a release beside every reserve (the budget is
    given back when the read fails), so a reserve alone gets a release that
    does nothing.  An exception from release cannot travel through C: it is
    dropped, after on_release_error() (when given) has been called inside
    the handler, so that a logger's exception() sees it."""

    def __init__(self, reserve: Optional[Callable[[int], bool]],
                 release: Optional[Callable[[int], None]],
                 on_release_error: Optional[Callable[[], None]] = None) -> None:
        self.exc: Optional[BaseException] = None
        self.reserve = reserve
        self.release = release
        self.on_release_error = on_release_error
        self.opts = L.PromoteOpts()
        L.check(L.kvt_promote_opts_init(ctypes.byref(self.opts), L.KVT_PROMOTE_OPTS_VERSION))
        if reserve is not None:
            self.c_reserve = L.RESERVE_FN(self._reserve)
            self.opts.reserve = self.c_reserve
        if release is not None or reserve is not None:
            self.c_release = L.RELEASE_FN(self._release)
            self.opts.release = self.c_release

    def _reserve(self, _ctx: Any, nbytes: int) -> int:
        try:
            return 1 if self.reserve(int(nbytes)) else 0
        except BaseException as e:  # raised by the front end once C returns
            self.exc = e
            return 0

    def _release(self, _ctx: Any, nbytes: int) -> None:
        if self.release is None:
            return
        try:
            self.release(int(nbytes))
        except BaseException:
            if self.on_release_error is not None:
                self.on_release_error()


async def _wait(promise: int) -> None:
    """Returns once the promise is complete."""
    loop = asyncio.get_running_loop()
    fd = L.kvt_promise_fd(promise)
    if fd >= 0:
        fut = loop.create_future()

        def _ready() -> None:
            if not fut.done():
                fut.set_result(None)

        try:
            loop.add_reader(fd, _ready)
        except (NotImplementedError, RuntimeError):
            pass  # a loop that cannot watch descriptors: poll below
        else:
            try:
                await fut
            finally:
                loop.remove_reader(fd)
            return
    delay = 0.0005
    while L.kvt_promise_wait(promise, 0) == L.KVT_ETIMEDOUT:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)


async def settle(promise: int, finish: Callable[[int, ctypes.c_void_p], T]) -> T:
    """Awaits the promise and returns finish(rc, entry): kvt_promise_result's
    code and entry pointer, called before the promise is freed (this
    thread's error message is still the result's).  An exception during the
    await cancels the read, frees the promise and propagates."""
    try:
        await _wait(promise)
    except BaseException:
        L.kvt_promise_cancel(promise)
        L.kvt_promise_free(promise)
        raise
    e = ctypes.c_void_p()
    rc = L.kvt_promise_result(ctypes.byref(e), promise)
    try:
        return finish(rc, e)
    finally:
        L.kvt_promise_free(promise)
