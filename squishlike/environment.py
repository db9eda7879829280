"""Every SQUISHLIKE_* environment variable squishlike reads, read here and only here (docs/environment.md).

The switches are on with 1 and off with 0; unset (or empty) means the default. Any other value is refused, naming
the variable: a typo such as `SQUISHLIKE_VERIFY=yes` must not quietly mean either. The fault seam's variables are
for the crash tests (squishlike/io/fault.py) and are read as text.
"""

from __future__ import annotations

import os

from .errors import EnvironmentSwitchError

SWITCHES: dict[str, bool | None] = {  # name -> default (None: measured at run time); docs/environment.md
    "SQUISHLIKE_VERIFY": False,  # every load checks every recorded hash, as load(verify=True)
    "SQUISHLIKE_BACKGROUND_BUILD": True,  # a first load writes its dense tier on a background thread
    "SQUISHLIKE_HUGEPAGES": None,  # Linux: weights go to huge-page-backed memory (unset: where 4 KiB pages are slow)
    "SQUISHLIKE_DIRECT_IO": True,  # tier files are written with O_DIRECT
    "SQUISHLIKE_OPENBLAS": True,  # eval and calibrating compress restart with the system OpenBLAS preloaded
}
FAULT_SEAM = ("SQUISHLIKE_FAULT_AT", "SQUISHLIKE_FAULT_NTH", "SQUISHLIKE_FAULT_ACTION", "SQUISHLIKE_FAULT_LOG")


def switch(name: str) -> bool | None:
    """The switch `name` (a key of SWITCHES): its default when unset (None for one the caller measures), else 1 or
    0."""
    default = SWITCHES[name]
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        what = "measured" if default is None else int(default)
        raise EnvironmentSwitchError(f"{name}={value}: a squishlike switch is 1 (on) or 0 (off), or unset for its "
                                     f"default ({what})")
    return value == "1"


def fault_setting(name: str) -> str | None:
    """One of the fault seam's variables (FAULT_SEAM), as text; None when unset."""
    assert name in FAULT_SEAM, name
    return os.environ.get(name) or None
