"""Every file squishlike writes goes through this package, so that a crash, a kill or a full disk at any moment
leaves either the old state or the new one, never a half-written file under its final name.

The rules (docs/format.md §8):
- A file is written under a temporary name in the directory it will live in (same filesystem, so the rename
  below is atomic), fsynced, renamed to its final name, and then the directory is fsynced, so the rename itself
  survives a power cut (`atomic`).
- A directory (a model, a tier) is built the same way: filled under a temporary name, every file fsynced, then
  renamed or atomically exchanged into place (`atomic.publish_dir`).
- Writers of one directory hold its lock (`lock`), so two processes never build the same thing at once and a
  crashed writer's temp files can be removed safely.
- A tier's sentinel is written last and records the size and checksum of every file of the tier (`sentinel`,
  `checksum`), so a sentinel only ever describes complete data.
- Big files are streamed and checksummed while written (`stream`), never re-read to be checksummed.

`fault` is the one place where tests inject crashes; it sits on the write path production uses.
"""
