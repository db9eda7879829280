"""Smoke test of an installed squishlike wheel: run it with the python of a venv that holds the wheel.

    python scripts/smoke_test.py

It builds a tiny random-weight llama (tests/support/tiny_models.py), compresses it to INT8, runs `python -m squishlike
inspect` and `verify` on the store, loads it cold with the Rust extension and checks its logits against
`mlx_lm.load` of the source. It works in a temporary directory, and fails if squishlike is imported from the source
tree instead of the installed wheel.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "tests"))

import mlx_lm  # noqa: E402
import squishlike  # noqa: E402
import rust_quant  # noqa: E402
from support.tiny_models import TINY_CONFIGS, cosine, logits, make_hf_model, make_tokenizer  # noqa: E402


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"smoke test failed: {what}")


def run_cli(*args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "squishlike", *args], cwd=cwd, capture_output=True, text=True)
    check(result.returncode == 0, f"`squishlike {' '.join(args)}` exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def main() -> None:
    for module in (squishlike, rust_quant):
        check(REPO not in Path(module.__file__).resolve().parents, f"{module.__name__} comes from {module.__file__}")
    print(f"squishlike {squishlike.__version__} from {Path(squishlike.__file__).parent}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer_dir = make_tokenizer(tmp / "tokenizer")
        source = make_hf_model(tmp / "tiny-llama", TINY_CONFIGS["llama"], tokenizer_dir)
        store = squishlike.compress(source, tmp / "tiny-int8", scheme="int8")
        print(run_cli("inspect", str(store), cwd=tmp).splitlines()[0])
        run_cli("verify", str(store), cwd=tmp)

        model, tokenizer = squishlike.load(str(store), tier="cold")
        reference, _ = mlx_lm.load(str(source))
        tokens = tokenizer.encode("The capital of France is")
        similarity = cosine(logits(model, tokens), logits(reference, tokens))
        check(similarity > 0.99, f"INT8 logits differ from mlx_lm.load's: cosine {similarity:.4f}")
        text = mlx_lm.generate(model, tokenizer, "The capital of France is", max_tokens=4)
        print(f"compress, inspect, verify, cold load: ok (logit cosine {similarity:.4f}, generated {text!r})")


if __name__ == "__main__":
    main()
