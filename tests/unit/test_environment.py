"""The SQUISHLIKE_* environment variables: one convention (1 on, 0 off, unset the default), read in one module
(squishlike/environment.py), each documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from squishlike.environment import FAULT_SEAM, SWITCHES, switch
from squishlike.errors import EnvironmentSwitchError

ROOT = Path(__file__).parents[2]
NAME = re.compile(r"SQUISHLIKE_[A-Z_]*[A-Z]")


def test_every_variable_the_code_names_is_declared_and_read_in_one_place():
    declared = set(SWITCHES) | set(FAULT_SEAM)
    for source in [*(ROOT / "squishlike").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        text = source.read_text()
        assert set(NAME.findall(text)) <= declared, source
        if source.name != "environment.py":
            assert not re.search(r"(environ\.get|getenv|environ\[)\(?\s*[\"']SQUISHLIKE_", text), source


def test_every_variable_is_documented():
    docs = (ROOT / "docs" / "environment.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in [*SWITCHES, *FAULT_SEAM]:
        assert f"`{name}`" in docs, name
    for name in SWITCHES:
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_one_convention(monkeypatch, name):
    default = SWITCHES[name]
    monkeypatch.delenv(name, raising=False)
    assert switch(name) is default
    monkeypatch.setenv(name, "")
    assert switch(name) is default
    monkeypatch.setenv(name, "1")
    assert switch(name) is True
    monkeypatch.setenv(name, "0")
    assert switch(name) is False
    for typo in ("yes", "true", "off", "2"):
        monkeypatch.setenv(name, typo)
        with pytest.raises(EnvironmentSwitchError, match=rf"^{name}={typo}: a squishlike switch is 1 \(on\) or 0"):
            switch(name)


def test_a_load_refuses_a_mistyped_switch(monkeypatch, tiny_llama, tmp_path):
    import squishlike

    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8")
    before = sorted(p.name for p in store.iterdir())
    monkeypatch.setenv("SQUISHLIKE_VERIFY", "yes")
    with pytest.raises(EnvironmentSwitchError, match="SQUISHLIKE_VERIFY=yes"):
        squishlike.load(store)
    assert sorted(p.name for p in store.iterdir()) == before  # refused before any tier was built
