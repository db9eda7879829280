"""Where a model reference points on this machine: a local path, or a Hugging Face repo already in the local
cache, resolved offline the way mlx_lm does (squishlike never downloads)."""

from __future__ import annotations

from pathlib import Path


def resolve_local(path_or_repo: str | Path, revision: str | None = None) -> Path | None:
    """The local path for `path_or_repo`, or None when it is neither a path nor a cached repo id."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    # Imported here: a local path (the common case, and the fast-load path) needs none of huggingface_hub.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path_or_repo), revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, ValueError, OSError):
        return None
