"""The load-time benchmark, every figure a whole fresh process (`python -m benchmarks.loadbench`, `squishlike bench`).

A timed load is a fresh process (squishlike/loadtime.py: spawn to model and tokenizer ready, its phases and
memory, a first forward pass apart); the floors and compress runs are fresh processes too (probes.py).

One run measures, alternating the configurations round by round (A B C ... A B C ...):
- warm loads (the files' pages cached): mlx_lm.load of the source directory and each squishlike tier;
- cold loads: the files' pages evicted with posix_fadvise(DONTNEED), checked gone with mincore, before each run;
- in-process loads: `load()` timed in a process that imported mlx_lm first (a server switching models), until the
  weights are evaluated and the tokenizer is ready, for mlx_lm.load and each squishlike tier;
- to first token: a whole process with the tier `load` takes by default, to ready and to the first token of a
  fixed 64-token prompt, then tokens/s after it, against the same script with mlx_lm.load;
- the first load of a fresh npy-dir (the cold path dequantizes the store and builds the tier this device takes);
- the floors, in the same run: the memory floor (a fresh process reading the same bytes into fresh memory, the
  fastest way we know: huge pages, one thread per core), the disk floor (sequential read bandwidth from
  evicted pages) and the startup floor (interpreter, import mlx_lm and transformers, the tokenizer: what any
  drop-in for mlx_lm.load does besides the weights, so its ratio to mlx_lm.load bounds every speedup);
- compress time and throughput (MB/s of bf16 source) with its peak memory.
Per figure: median, min, max of the runs, the peak RSS above the startup floor's (compress: above the child's
own after its imports), the bytes on disk.

Fresh memory on the VMs this project runs on is slow and its speed depends on history (the VM hands free 2 MiB
blocks back to the host about 2 s after they are freed, and touching them again costs a host fault per
4 KiB). Runs follow each other back to back, so every configuration starts right after another process freed a
similar amount of memory. `--prime` makes that explicit: before each timed run the parent touches and frees as
much memory as the run needs, so every child starts with recently used memory.

Modules: `models` builds the inputs, `stores` the npy-dirs, `probes` runs in the child processes, `pagecache`
evicts and checks files' pages, `run` plans and runs the figures, `results` summarises them against the targets,
`report` writes Markdown and the chart, `cli` is the command line.
"""

from .cli import add_arguments, main, run
from .run import run_benchmark

__all__ = ["add_arguments", "main", "run", "run_benchmark"]
