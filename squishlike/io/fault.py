"""The fault-injection seam of the crash tests (tests/support/crash_harness.py, tests/fuzz/crash_sweep.py).

`fault_point(label)` is called at every boundary of the write path: before and after each rename, after the first
bytes of each file reach the disk, on taking a lock, on creating a temp directory. It does nothing unless the
environment asks, and never changes what the writers do, so the crash tests exercise the path production uses.

SQUISHLIKE_FAULT_AT=<glob>      act at a boundary whose label matches (labels: "kind:file name", e.g.
                                "before-rename:manifest.json", "publish:finalized", "lock:out").
SQUISHLIKE_FAULT_NTH=<n>        ... at the n-th matching boundary this process reaches (default 1).
SQUISHLIKE_FAULT_ACTION=<what>  kill (default: SIGKILL, a real kill -9), exit (os._exit(137)),
                                sigint (a real SIGINT, as Ctrl-C), enospc (raise OSError ENOSPC, as disk full),
                                pause:<seconds> (sleep there, then go on: holds a lock open for race tests).
SQUISHLIKE_FAULT_LOG=<file>     append "pid label" for every boundary reached (to enumerate them).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
import time

from ..environment import fault_setting

_hits = 0  # how many boundaries matching SQUISHLIKE_FAULT_AT this process has passed


def fault_point(label: str) -> None:
    log = fault_setting("SQUISHLIKE_FAULT_LOG")
    target = fault_setting("SQUISHLIKE_FAULT_AT")
    if not (log or target):
        return
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {label}\n".encode())  # one small O_APPEND write: lines never interleave
        finally:
            os.close(fd)
    if not target or not fnmatch.fnmatchcase(label, target):
        return
    global _hits
    _hits += 1
    if _hits != int(fault_setting("SQUISHLIKE_FAULT_NTH") or 1):
        return
    action = fault_setting("SQUISHLIKE_FAULT_ACTION") or "kill"
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sigint":
        os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt at the next bytecode
        time.sleep(0.01)
        return  # SIGINT ignored by this process: carry on, as it would
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (fault injected at {label})")
    elif action.startswith("pause:"):
        time.sleep(float(action.split(":", 1)[1]))
        return
    os._exit(137)  # "exit", or anything unknown: die without cleanup
