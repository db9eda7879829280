"""Where a model reference points on this machine, found as `mlx_lm.load` finds it.

An existing path is itself. Otherwise a Hugging Face repo id goes through mlx_lm's own download
(`mlx_lm.utils._download`: huggingface_hub's `snapshot_download` with mlx_lm's allow patterns), so the local cache,
`HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `revision` behave exactly as they do for mlx_lm. An Ollama `name:tag` (not a
repo id) is left for the provider to resolve.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelNotFoundError


def resolve(path_or_repo: str | Path, revision: str | None = None) -> Path | str:
    """The local path of `path_or_repo`: the path itself, or the snapshot of the repo it names (downloaded unless
    cached). What is neither comes back unchanged, and so does a repo-shaped name whose first part is a local
    directory: a mistyped local path, which the Hub would only confuse. ModelNotFoundError says why a repo could not be had."""
    existing = existing_path(path_or_repo)
    if existing is not None:
        return existing
    path = Path(path_or_repo).expanduser()
    ref = str(path_or_repo)
    if not is_repo_id(ref) or path.parent.name and path.parent.is_dir():  # "stores/nope" in a tree with stores/
        return ref
    from .formats.ollama import OllamaReader  # an untagged Ollama name ("llama3") is a valid repo id too

    if OllamaReader.resolve(ref) is not None:
        return ref
    return download(ref, revision)


def existing_path(path_or_repo: str | Path) -> Path | None:
    """`path_or_repo` as a path (`~` expanded) when something exists there, else None; ModelNotFoundError when it
    cannot name a file at all (too long for the filesystem, a NUL byte), which Path.exists would raise or hide."""
    ref = str(path_or_repo)
    try:
        if "\0" in ref:
            raise ValueError("embedded NUL byte")
        path = Path(ref).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(ref, f"not a usable path ({getattr(e, 'strerror', None) or e})") from None


def is_repo_id(ref: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def download(repo: str, revision: str | None = None) -> Path:
    """The snapshot of `repo` in the local Hugging Face cache, fetched by mlx_lm's download when not there."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from mlx_lm.utils import _download

    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(_download(repo, revision=revision))
    except LocalEntryNotFoundError as e:
        # Newer huggingface_hub raises its subclass IncompleteSnapshotError, with the snapshot's path, when the
        # snapshot is cached but lacks files its cached listing names (an interrupted download): not "not cached".
        snapshot = getattr(e, "snapshot_path", None)
        if snapshot:
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
            raise ModelNotFoundError(
                repo,
                f"the Hugging Face repo {repo}{at} is only partly in the local cache ({snapshot} lacks some of its "
                f"files: an interrupted download?) and {why}; complete it with `huggingface-cli download {repo}`",
            ) from None
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                repo,
                f"no such file or directory, and the Hugging Face repo {repo}{at} is not in the local cache "
                f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set; fetch it with "
                f"`huggingface-cli download {repo}`, or unset HF_HUB_OFFLINE to let squishlike download it",
            ) from None
        raise ModelNotFoundError(
            repo,
            f"no such file or directory, and the Hugging Face repo {repo}{at} is neither in the local cache "
            f"({constants.HF_HUB_CACHE}) nor reachable on the Hub; check the network, or fetch it elsewhere with "
            f"`huggingface-cli download {repo}`",
        ) from None
    except GatedRepoError:
        raise ModelNotFoundError(
            repo, f"the Hugging Face repo {repo} is gated; accept its terms on the Hub, then `huggingface-cli login`"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            repo,
            f"no such file or directory, and no Hugging Face repo {repo} "
            "(a private repo needs `huggingface-cli login`)",
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(repo, f"the Hugging Face repo {repo} has no revision {revision!r}") from None
