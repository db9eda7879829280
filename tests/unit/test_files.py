"""squishlike/io/files.py, the one rule for a file inside a directory squishlike was given (issue 44): reached from
that directory with no link followed anywhere on the way, a regular file checked before a byte is read, a FIFO
never opened; deletes remove a link itself; files squishlike writes are always new, never written through a link."""

from __future__ import annotations

import os

import pytest

from squishlike.errors import FormatError
from squishlike.io.atomic import stream_file
from squishlike.io.files import open_regular, plain_tree, read_bytes, regular_file, remove_inside


@pytest.fixture
def tree(tmp_path):
    """root/a/file, and outside/secret with outside/fifo, a FIFO no one writes to (opening it would block)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    (root / "a" / "file").write_bytes(b"inside")
    outside.mkdir()
    (outside / "secret").write_bytes(b"outside")
    os.mkfifo(outside / "fifo")
    return root, outside


def test_a_file_inside_is_read(tree):
    root, _ = tree
    assert read_bytes(root / "a" / "file", root) == b"inside"
    assert regular_file(root / "a" / "file", root) == root / "a" / "file"


@pytest.mark.parametrize("link_at, then", [("a/link", ""), ("b", "/secret"), ("b", "/fifo"), ("a/fifo", "")])
def test_a_link_anywhere_on_the_way_is_refused(tree, link_at, then):
    root, outside = tree
    target = outside / ("fifo" if link_at.endswith("fifo") else "secret") if not then else outside
    (root / link_at).symlink_to(target)
    path = root / (link_at + then)
    for check in (lambda: open_regular(path, root), lambda: regular_file(path, root)):
        with pytest.raises(FormatError, match=f"{root / link_at}: is a symbolic link"):
            check()


def test_a_fifo_or_a_directory_is_refused_without_blocking(tree):
    root, _ = tree
    os.mkfifo(root / "a" / "fifo")
    with pytest.raises(FormatError, match="is a FIFO, not a regular file"):
        open_regular(root / "a" / "fifo", root)
    with pytest.raises(FormatError, match="is a directory, not a regular file"):
        open_regular(root / "a", root)


@pytest.mark.parametrize("rel", ["../outside/secret", "a/../../outside/secret", "."])
def test_a_path_that_leads_out_of_the_root_is_refused(tree, rel):
    root, _ = tree
    with pytest.raises(FormatError, match="leads outside"):
        open_regular(root / rel, root)


def test_remove_inside_removes_a_link_itself_never_its_target(tree):
    root, outside = tree
    (root / "a" / "link").symlink_to(outside)
    (root / "a" / "inner").mkdir()
    (root / "a" / "inner" / "link").symlink_to(outside / "secret")
    assert plain_tree(root) in (root / "a" / "link", root / "a" / "inner" / "link")
    remove_inside(root / "a", root)
    assert not (root / "a").exists() and sorted(p.name for p in outside.iterdir()) == ["fifo", "secret"]
    assert (outside / "secret").read_bytes() == b"outside" and plain_tree(root) is None
    (root / "b").symlink_to(outside)
    with pytest.raises(FormatError, match="is a symbolic link"):
        remove_inside(root / "b" / "secret", root)
    assert (outside / "secret").exists()


@pytest.mark.parametrize("planted", ["symlink", "hardlink"])
def test_a_written_file_is_always_new_never_written_through_what_is_there(tree, planted):
    root, outside = tree
    (os.symlink if planted == "symlink" else os.link)(outside / "secret", root / "new")
    with pytest.raises(OSError), stream_file(root / "new") as w:
        w.write(b"overwritten")
    assert (outside / "secret").read_bytes() == b"outside"
