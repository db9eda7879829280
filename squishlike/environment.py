"""Every SQUISHLIKE_* environment variable squishlike reads, read here and only here (docs/environment.md).

The switches are on with 1 and off with 0; unset (or empty) means the default. Any other value is refused, naming
the variable: a typo such as `SQUISHLIKE_VERIFY=yes` must not quietly mean either. The fault seam's variables are
for the crash tests (squishlike/io/fault.py) and are read as text.
"""

from __future__ import annotations

import os

from .errors import EnvironmentSwitchError

SWITCHES: dict[str, tuple[bool, str]] = {  # name -> (default, what "1" does)
    "SQUISHLIKE_VERIFY": (False, "every load checks every recorded hash, SHA-256 too, as load(verify=True) does"),
    "SQUISHLIKE_BACKGROUND_BUILD": (True, "a first load returns before its dense tier is on disk and writes it on "
                                    "a background thread (0: the load waits for the write)"),
    "SQUISHLIKE_HUGEPAGES": (True, "Linux: weights go to huge-page-backed memory (0: plain malloc)"),
    "SQUISHLIKE_DIRECT_IO": (True, "tier files are written with O_DIRECT where the filesystem allows it (0: through "
                             "the page cache)"),
    "SQUISHLIKE_OPENBLAS": (True, "eval and calibrating compress restart once with the system OpenBLAS preloaded "
                            "(0: never)"),
}
FAULT_SEAM = ("SQUISHLIKE_FAULT_AT", "SQUISHLIKE_FAULT_NTH", "SQUISHLIKE_FAULT_ACTION", "SQUISHLIKE_FAULT_LOG")


def switch(name: str) -> bool:
    """The switch `name` (a key of SWITCHES): its default when unset, else 1 or 0."""
    default, _ = SWITCHES[name]
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise EnvironmentSwitchError(f"{name}={value}: a squishlike switch is 1 (on) or 0 (off), or unset for its "
                                     f"default ({int(default)})")
    return value == "1"


def fault_setting(name: str) -> str | None:
    """One of the fault seam's variables (FAULT_SEAM), as text; None when unset."""
    assert name in FAULT_SEAM, name
    return os.environ.get(name) or None
