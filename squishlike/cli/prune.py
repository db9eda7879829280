"""Remove an npy-dir's tier caches to free disk, holding its directory lock: by default every tier but the one
`load` takes on this device, and every rank share (`sharded_load`'s); or all but those named in --keep ("rank" keeps
the shares). The store itself (manifest, tensors/, side files) is never touched, and a later load (or launch) that
needs a removed tier (or share) builds it again."""

from __future__ import annotations

import argparse

HELP = "remove an npy-dir's tier caches (all but the one load takes here, or all but --keep)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the npy-dir")
    parser.add_argument("--keep", type=lambda s: tuple(t for t in s.split(",") if t), metavar="TIERS",
                        help="comma-separated tiers to keep, 'rank' for the rank shares (default: the tier `load` "
                             "takes here; '' keeps none)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..errors import FormatError
    from ..npydir import MANIFEST, NpyDir, is_npydir
    from ..tiers import BY_NAME, COLD, choice
    from ..tiers.prune import SHARES, prune
    from ..tiers.rank import RankTier

    if Path(args.path).is_dir() and not is_npydir(args.path, damaged=True):
        raise FormatError(args.path, f"not a squishlike store (no {MANIFEST})")
    store = NpyDir(args.path)
    if args.keep is None:
        served, _ = choice(store)
        args.keep = () if served == COLD.name else (served,)
    freed = prune(store, args.keep)
    for name, nbytes in freed.items():
        if nbytes:
            print(f"removed tier {name}: {nbytes / 1e6:.1f} MB")
    kept = [name for name in args.keep if any(t.ready(store)[0] is not None for t in (
        RankTier.cached(store) if name == SHARES else [BY_NAME[name]]))]
    absent = [name for name in args.keep if name not in kept]
    print(f"{store.path}: freed {sum(freed.values()) / 1e6:.1f} MB; kept {', '.join(kept) or 'no tier'}"
          + "".join(f"; {name} is not on disk" for name in absent))
    return 0
