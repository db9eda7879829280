"""Cache builds that outlive the load: the first load of a fresh store returns the model as soon as the store is
dequantized, and writes the dense tier it was dequantized into on a background thread.

Why: writing a dense tier is a disk-bound copy of the model's bytes (3.09 GB for a 1.5B model; ~8 s at the
0.4 GB/s of a cloud disk) that the load's caller never waits for otherwise: the model in memory is already the one
the tier will hold. The thread holds the store's directory lock until the tier is published (or abandoned), so a
second load of the store, in this process or another, waits for it and then takes the tier. At interpreter exit
the build is waited for (atexit), so a script that loads and exits still leaves the cache behind; a process killed
before the end leaves only temps, which the next writer under the lock removes.

SQUISHLIKE_BACKGROUND_BUILD=0 makes the first load wait for its build, with a progress bar on a terminal.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  registers its exit hook before ours (see the end of this module)
import logging
import sys
import threading
import time
from typing import Callable

from ..environment import switch

log = logging.getLogger("squishlike")

_builds: list[threading.Thread] = []
_guard = threading.Lock()


def background_wanted() -> bool:
    """Whether a first load hands its dense tier's build to a background thread (SQUISHLIKE_BACKGROUND_BUILD)."""
    return switch("SQUISHLIKE_BACKGROUND_BUILD")


def start(label: str, build: Callable[[], None]) -> None:
    """Run `build` on a thread; it owns whatever the caller handed it (the lock) and must release it. Its errors
    are logged as warnings: the load it came from has already succeeded."""

    def run() -> None:
        started = time.perf_counter()
        try:
            build()
            log.info("%s: background build done in %.1f s", label, time.perf_counter() - started)
        except BaseException as e:  # noqa: BLE001  nothing to raise into: the load returned long ago
            log.warning("%s: background build failed (%s: %s); a later load builds it again", label,
                        type(e).__name__, e)

    thread = threading.Thread(target=run, name=f"squishlike-build:{label}", daemon=True)
    with _guard:
        _builds[:] = [t for t in _builds if t.is_alive()]
        _builds.append(thread)
    thread.start()


def pending() -> list[str]:
    """The labels of the builds still running."""
    with _guard:
        return [t.name.removeprefix("squishlike-build:") for t in _builds if t.is_alive()]


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait for every background build of this process; True when none is left running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _guard:
        threads = list(_builds)
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not pending()


def _finish_at_exit() -> None:
    left = pending()
    if left:
        if sys.stderr is not None and sys.stderr.isatty():
            print(f"squishlike: finishing the cache build of {', '.join(left)} before exit "
                  "(Ctrl-C skips it; the next load builds it again)", file=sys.stderr)
        wait_for_builds()


# Wait before concurrent.futures stops taking work at exit (the writers use thread pools): threading's own exit
# hooks run before atexit's, last registered first, and concurrent.futures.thread (imported above) registered its
# hook first.
getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)
