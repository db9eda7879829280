#!/usr/bin/env python3
"""Load-time benchmark: mlx_lm.load vs every squishlike tier, warm and cold, with floors, first load and compress.

    python benchmarks/bench_load.py --model qwen1.5b        # the full run (~15 min on 2 cores)
    python benchmarks/bench_load.py --quick                 # smoke run on SmolLM2-135M (~1-2 min)
    python benchmarks/bench_load.py --model PATH            # any HF/MLX model directory as the source

Same as `squishlike bench` and `python -m benchmarks.loadbench`. Every figure is a whole fresh process; see
benchmarks/loadbench/__init__.py for what is measured and how, and benchmarks/README.md for a real run.
"""

import sys

from loadbench import main  # run as a script, this directory is on sys.path

if __name__ == "__main__":
    sys.exit(main())
