"""Model names -> local folders: a folder or config.json as given, a catalog name as is, a Hugging Face id
from the local Hugging Face cache. Offline: nothing is ever downloaded. No torch.

The cache layout is huggingface_hub's (documented in its "Manage the cache" guide):
    <cache>/models--{org}--{name}/refs/{revision}     holds the commit hash a branch or tag points at
    <cache>/models--{org}--{name}/snapshots/{commit}/ the files of that commit
where <cache> is $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its old name), else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvfit import catalog
from kvfit.errors import ConfigError

DEFAULT_REVISION = "main"
# an id as the Hub spells them: "name" or "org/name", letters, digits, '-', '_', '.' (no leading dot)
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# a branch or tag name: no path tricks (it names a file under refs/)
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, found as huggingface_hub finds it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a Hugging Face model id ("org/name" or a legacy bare "name")."""
    return bool(_ID_RE.match(name)) and not name.endswith(".json") and ".." not in name


def resolve_model(name: str, revision: str | None = None) -> Path:
    """The folder (or config.json) of model `name`: an existing path as is, else the snapshot of the
    Hugging Face id `name` at `revision` (default main) in the local cache. A missing one is a one-line
    ConfigError naming the places looked in."""
    path = Path(name).expanduser()
    if path.exists():
        if revision is not None and path.parent.name != "snapshots":
            raise ConfigError(f"--revision {revision} selects a revision of a Hugging Face id in the local cache, "
                              f"but {name} is a folder; drop --revision or give the model's id")
        return path
    if not is_hub_id(name):
        raise ConfigError(f"no model folder or config.json at {name}: it does not exist ({path.absolute()})")
    return _cached_snapshot(name, revision or DEFAULT_REVISION, path)


def resolve_model_name(name: str, revision: str | None = None) -> str:
    """resolve_model as a string, except that a catalog name (kvfit.catalog, no such folder here) stays
    as it is: `kvfit plan` sizes it, the engine builds it with --load-format dummy."""
    if not os.path.exists(os.path.expanduser(name)) and _in_catalog(name):
        if revision is not None:
            raise ConfigError(f"--revision {revision} applies to Hugging Face ids; {name} is a catalog model")
        return name
    return str(resolve_model(name, revision))


def _in_catalog(name: str) -> bool:
    try:
        catalog.model_config(name)
    except ConfigError:
        return False
    return True


def _cached_snapshot(model_id: str, revision: str, local: Path) -> Path:
    repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
    if not (_COMMIT_RE.match(revision) or _REVISION_RE.match(revision)) or ".." in revision:
        raise ConfigError(f"--revision {revision!r} is not a branch, tag or 40-character commit hash")
    if not repo.is_dir():
        known = "" if "/" in model_id else f", not a catalog model ({', '.join(catalog.MODELS)})"
        raise ConfigError(
            f"unknown model {model_id!r}: no folder {local.absolute()}{known}, and not in the Hugging Face cache "
            f"(looked for {repo}); kvfit never downloads: fetch it with `hf download {model_id}` or give a folder")
    commit = revision if _COMMIT_RE.match(revision) else _read_ref(repo, revision, model_id)
    snapshot = repo / "snapshots" / commit
    if not (snapshot / "config.json").is_file():
        raise ConfigError(f"{model_id} at revision {revision} is not complete in the Hugging Face cache "
                          f"({snapshot} has no config.json); fetch it again with `hf download {model_id}`")
    return snapshot


def _read_ref(repo: Path, revision: str, model_id: str) -> str:
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        refs = sorted(p.relative_to(repo / "refs").as_posix() for p in (repo / "refs").rglob("*") if p.is_file())
        raise ConfigError(f"{model_id} has no revision {revision!r} in the Hugging Face cache (looked for {ref}; "
                          f"cached refs: {', '.join(refs) or 'none'}); pass --revision with one of them or a "
                          "commit hash") from None
    if not _COMMIT_RE.match(commit):
        raise ConfigError(f"{ref} does not hold a commit hash (got {commit[:60]!r}); fetch {model_id} again")
    return commit
