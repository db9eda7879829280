"""`load` imports mlx_lm without transformers' AutoTokenizer registry (squishlike/mlx_lm_import.py), and everything
that uses AutoTokenizer afterwards gets the real class with mlx_lm's registration in it, as after `import mlx_lm`.
Each case is a fresh interpreter: what an import did cannot be undone in this one."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.tiny_models import TINY_CONFIGS, make_hf_model

import squishlike

AUTO = "transformers.models.auto.tokenization_auto"
CHECK = f"""
import sys
source, store, first = sys.argv[1:]
if first == "mlx_lm":
    import mlx_lm
import squishlike
model, tokenizer = squishlike.load(store)
deferred = {AUTO!r} not in sys.modules
tokenizer.decode(tokenizer.encode("Hello world"))
print("deferred", deferred, {AUTO!r} not in sys.modules)
import mlx_lm
import mlx_lm.tokenizer_utils as tokenizer_utils
if first == "transformers":  # any code's own AutoTokenizer first: the real class, mlx_lm's tokenizer registered
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    print("real", AutoTokenizer.__module__ == {AUTO!r},
          tokenizer_class_from_name("NewlineTokenizer") is tokenizer_utils.NewlineTokenizer)
_, theirs = mlx_lm.load(source)  # mlx_lm's own tokenizer path, through AutoTokenizer
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
print("after", tokenizer_utils.AutoTokenizer is AutoTokenizer,
      tokenizer_class_from_name("NewlineTokenizer") is tokenizer_utils.NewlineTokenizer,
      theirs.encode("Hello world") == tokenizer.encode("Hello world"))
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("import")
    from support.tiny_models import make_tokenizer

    source = make_hf_model(root / "src", TINY_CONFIGS["llama"], make_tokenizer(root / "tokenizer"))
    return source, squishlike.compress(source, root / "store", scheme="int4")


def run(models, first: str) -> str:
    done = subprocess.run([sys.executable, "-c", CHECK, *map(str, models), first], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("first", ["mlx_lm.load", "transformers"])
def test_a_load_leaves_auto_tokenizer_to_its_first_use(models, first):
    out = run(models, first)
    assert "deferred True True" in out  # neither the load nor its tokenizer's use imported the registry
    if first == "transformers":
        assert "real True True" in out
    assert "after True True True" in out


def test_after_import_mlx_lm_a_load_imports_nothing_more(models):
    out = run(models, "mlx_lm")
    assert "deferred False False" in out  # mlx_lm's own import paid for it: nothing was deferred
    assert "after True True True" in out
