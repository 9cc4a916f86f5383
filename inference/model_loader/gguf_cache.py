"""The on-disk cache of converted GGUF files.

Layout: ``$TESSERA_CACHE_DIR/gguf/<file stem>-<key>/`` (default root
``~/.cache/tessera``), where ``<key>`` is 16 hex digits of a SHA-256 over the GGUF
file's absolute real path, size in bytes and modification time in nanoseconds, plus
``CACHE_FORMAT_VERSION``. Editing or replacing the file therefore changes the key and
triggers a fresh conversion. Each entry records its source (``source.json``: path, size,
modification time); a conversion removes the entries whose source file is gone or has
changed since (a reinstalled package, a deleted virtualenv), so that copies of a 0.5 GB
model do not pile up. Entries without ``source.json`` (written before it existed), and those
converted on another host sharing the cache directory, are left.

A cache hit only stats the GGUF file and the cache entry: it never opens the GGUF
file nor imports transformers or gguf.

Writes are atomic: a conversion goes into ``.<entry>.partial-<random>`` in the same parent
and is renamed to ``<entry>`` once complete, so an interrupted conversion never leaves
an entry that looks usable. Two processes converting the same file at once both work;
the first rename wins and the loser discards its copy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from ..errors import ModelLoadError

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TESSERA_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/tessera"
# Bump when the converter's output changes, so that old entries are not reused.
CACHE_FORMAT_VERSION = 1
_ENTRY_FILES = ("config.json", "tokenizer_config.json", "model.safetensors")
_SOURCE_FILE = "source.json"  # the GGUF file an entry was converted from
# A partial directory this old belongs to a conversion that was killed.
_STALE_PARTIAL_S = 3600.0


def cache_root() -> Path:
    """The cache root: ``$TESSERA_CACHE_DIR`` if set and non-empty, else ``~/.cache/tessera``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def cache_entry_dir(gguf_path: str | Path) -> Path:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet).

    Raises:
        ModelLoadError: ``gguf_path`` cannot be stat'ed.
    """
    path = Path(gguf_path).resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"Cannot read GGUF file {gguf_path}: {exc}") from exc
    identity = f"{CACHE_FORMAT_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80]
    return cache_root() / "gguf" / f"{stem}-{key}"


def is_complete(entry: Path) -> bool:
    """True when ``entry`` holds every file a conversion writes."""
    return all((entry / name).is_file() for name in _ENTRY_FILES)


def converted_dir(gguf_path: str | Path) -> Path:
    """Return the Hugging Face style directory for ``gguf_path``, converting on a miss.

    Returns:
        The cache entry directory (config.json, tokenizer files, model.safetensors).

    Raises:
        ModelLoadError: the file cannot be read or converted, or the cache directory
            cannot be written.
        UnsupportedArchitectureError: the file's architecture is not supported.
    """
    entry = cache_entry_dir(gguf_path)
    if is_complete(entry):
        return entry
    from .gguf_convert import convert_gguf  # imports torch; only needed on a miss

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(entry)
        if entry.exists() and not is_complete(entry):  # never ours: we only rename complete ones
            shutil.rmtree(entry)
        partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=entry.parent))
    except OSError as exc:
        raise ModelLoadError(f"Cannot write the model cache at {entry.parent} (set {CACHE_DIR_ENV}): {exc}") from exc
    logger.info("Converting %s into %s (first use; later loads reuse it)", gguf_path, entry)
    try:
        convert_gguf(gguf_path, partial)
        (partial / _SOURCE_FILE).write_text(json.dumps(_source_identity(Path(gguf_path).resolve())))
        _publish(partial, entry)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _remove_stale_entries(entry)
    return entry


def _source_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "host": socket.gethostname()}


def _remove_stale_entries(keep: Path) -> None:
    """Delete the cache entries converted on this host whose GGUF file no longer exists or has changed since
    (best effort: a load never fails here; entries of other hosts sharing the cache are left to them)."""
    try:
        entries = [entry for entry in keep.parent.iterdir() if entry != keep and not entry.name.startswith(".")]
    except OSError:
        return
    for entry in entries:
        try:
            source = json.loads((entry / _SOURCE_FILE).read_text())
            if source.get("host") != socket.gethostname():
                continue
            path = Path(source["path"])
            stale = not path.is_file() or _source_identity(path) != source
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # no source.json (an older entry), unreadable, or not ours
        if stale:
            logger.info("Removing the cache entry %s: its GGUF file %s is gone or changed", entry, path)
            shutil.rmtree(entry, ignore_errors=True)


def _publish(partial: Path, entry: Path) -> None:
    # mkdtemp makes the directory 0700 and safetensors writes 0600; other local users
    # (a Celery worker under another account) may share the cache, so open it up.
    partial.chmod(0o755)
    for file in partial.iterdir():
        file.chmod(0o644)
    try:
        os.rename(partial, entry)
    except OSError as exc:
        if is_complete(entry):  # another process finished the same conversion first
            return
        raise ModelLoadError(f"Cannot move converted model into {entry}: {exc}") from exc


def _remove_stale_partials(entry: Path) -> None:
    now = time.time()
    for partial in entry.parent.glob(f".{entry.name}.partial-*"):
        try:
            if now - partial.stat().st_mtime > _STALE_PARTIAL_S:
                shutil.rmtree(partial, ignore_errors=True)
        except OSError:
            pass
