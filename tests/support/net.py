"""Loopback helpers for the tests that run a server."""

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_answers(process: subprocess.Popen, url: str, log: Path, startup_s: float) -> None:
    """Poll `url` until it answers; fail, showing the server's `log`, if `process` exits or `startup_s` passes."""
    deadline = time.monotonic() + startup_s
    while True:
        assert process.poll() is None, f"the server exited with {process.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not answer in {startup_s} s:\n{log.read_text()}"
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            time.sleep(0.3)
