"""Content hashes, version stamps and atomic directory commits for what jaxfold writes.

A saved fold carries ``manifest.json``: the SHA-256 and size of every file under
it and the versions of the packages that wrote it.  :func:`verify_manifest`
re-hashes before anything (orbax, tensorstore, safetensors) parses a byte, so a
flipped bit, a truncated copy or a foreign file gives one :class:`IntegrityError`
naming the file instead of NaN outputs or a parser's traceback.

:func:`commit_directory` moves a fully written temporary sibling into place with
``rename`` (and, to replace an existing fold, Linux's atomic ``RENAME_EXCHANGE``;
elsewhere two renames under a lock file), so readers see the old fold or the
new one, never a mix, and concurrent writers end with exactly one complete fold.

Example:
    >>> write_manifest("/tmp/f.tmp", kind="jaxfold-fold")
    >>> verify_manifest("/tmp/f.tmp")          # raises IntegrityError on any change
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from typing import Iterable, Optional

from jaxfold._src.fold import FoldError

__all__ = ["IntegrityError", "NotFoundError", "NotADirectory", "IsADirectory", "versions", "sha256_file",
           "sha256_bytes", "write_manifest", "verify_manifest", "read_manifest", "verify_file", "commit_directory",
           "atomic_write_bytes", "MANIFEST", "snapshot", "read_verified", "sign_directory", "remove_stale",
           "DiskFullError", "SIGNATURE"]

MANIFEST = "manifest.json"


class IntegrityError(FoldError):
  """A saved fold or an exported artifact is damaged, truncated, foreign or was
  modified after it was written.  The message names the file and what to do.

  A :class:`jaxfold.FoldError` (and so a ``ValueError``): one ``except
  jaxfold.FoldError`` catches every refusal of jaxfold's loaders."""


# A wrong path is both an IntegrityError (so ``except jaxfold.FoldError`` sees
# every refusal) and the OSError a caller of a file API expects.
class NotFoundError(IntegrityError, FileNotFoundError):
  """The path does not exist or is not a saved fold / an artifact."""


class NotADirectory(IntegrityError, NotADirectoryError):
  """A file was given where a saved fold directory was expected."""


class IsADirectory(IntegrityError, IsADirectoryError):
  """A directory was given where an artifact file was expected."""


def versions() -> dict:
  """Versions of the packages whose formats a fold or an artifact depends on."""
  from importlib import metadata
  out = {"python": platform.python_version()}
  for name in ("jaxfold", "jax", "jaxlib", "flax", "orbax-checkpoint", "numpy"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  from jaxfold._src.version import __version__  # the source tree's version wins over an installed copy's
  out["jaxfold"] = __version__
  return out


def sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _walk(directory: str) -> list[str]:
  """Relative paths (``/``-separated) of every regular file under ``directory``."""
  out = []
  for root, dirs, files in os.walk(directory):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      if os.path.islink(full) or not os.path.isfile(full):
        continue
      out.append(os.path.relpath(full, directory).replace(os.sep, "/"))
  return out


def _fsync(path: str, directory: bool = False) -> None:
  flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
  try:
    fd = os.open(path, flags)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:  # some filesystems refuse fsync on directories
    pass
  finally:
    os.close(fd)


def write_manifest(directory: str, *, kind: str, extra: Optional[dict] = None) -> dict:
  """Hashes every file under ``directory`` into ``directory/manifest.json`` and
  fsyncs them, so a crash after the commit cannot leave a fold whose manifest
  promises bytes that never reached the disk."""
  files = {}
  for rel in _walk(directory):
    if rel == MANIFEST:
      continue
    full = os.path.join(directory, rel)
    files[rel] = {"sha256": sha256_file(full), "bytes": os.path.getsize(full)}
    _fsync(full)
  manifest = {"kind": kind, "written_by": versions(), "files": files, **(extra or {})}
  path = os.path.join(directory, MANIFEST)
  with open(path, "w") as f:
    json.dump(manifest, f, indent=2, sort_keys=True)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  for root, dirs, _ in os.walk(directory):
    for d in dirs:
      _fsync(os.path.join(root, d), directory=True)
  _fsync(directory, directory=True)
  return manifest


_REDO = ("re-create it (`jaxfold fold --force ...` or jaxfold.save_fold(..., overwrite=True)) "
         "or restore the directory from a good copy")


def read_manifest(directory: str, *, what: str = "saved fold") -> dict:
  with open(os.path.join(directory, MANIFEST), "rb") as f:
    raw = f.read()
  return _parse_manifest(raw, directory, what)


def _parse_manifest(raw: bytes, directory: str, what: str) -> dict:
  try:
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
      raise ValueError("no 'files' table")
  except (ValueError, UnicodeDecodeError) as e:
    raise IntegrityError(f"{os.path.join(directory, MANIFEST)} is damaged ({type(e).__name__}: {e}), "
                         f"so the {what} in {directory} cannot be verified: {_REDO}") from None
  for rel in manifest["files"]:
    if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/"):
      raise IntegrityError(f"{os.path.join(directory, MANIFEST)} lists a path outside the "
                           f"directory ({rel!r}): it is not a manifest written by jaxfold")
  return manifest


def verify_file(directory: str, rel: str, manifest: dict, *, what: str = "saved fold") -> None:
  """Checks one file of ``directory`` against its manifest entry."""
  full = os.path.join(directory, rel)
  want = manifest["files"].get(rel)
  if want is None:
    raise IntegrityError(f"{full} is not listed in {os.path.join(directory, MANIFEST)}: the "
                         f"{what} was modified after it was written (a stray or stale file); "
                         f"remove it or {_REDO}")
  if not os.path.isfile(full):
    raise IntegrityError(f"{full} is missing: the {what} in {directory} is incomplete (a partial "
                         f"copy?); {_REDO}")
  size = os.path.getsize(full)
  if size != want.get("bytes"):
    raise IntegrityError(f"{full} has {size} bytes, {want.get('bytes')} were written: it is "
                         f"truncated or was replaced; {_REDO}")
  if sha256_file(full) != want.get("sha256"):
    raise IntegrityError(f"{full} does not match its SHA-256 in the manifest: its content changed "
                         f"after it was written (disk or copy corruption, or an edit); {_REDO}")


def verify_manifest(directory: str, *, strict_under: Iterable[str] = (),
                    what: str = "saved fold") -> dict:
  """Re-hashes every file the manifest lists; files present under one of the
  ``strict_under`` folders but not listed (a stale shard) are refused too.
  Returns the manifest."""
  manifest = read_manifest(directory, what=what)
  for rel in sorted(manifest["files"]):
    verify_file(directory, rel, manifest, what=what)
  listed = set(manifest["files"])
  for top in strict_under:
    base = os.path.join(directory, top)
    if os.path.isdir(base):
      for rel in _walk(base):
        rel = f"{top}/{rel}"
        if rel not in listed:
          verify_file(directory, rel, manifest, what=what)   # raises: not listed
  return manifest


# ----------------------------------------------------------------------------
# Atomic replacement of a directory.

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths (Linux ≥ 3.15).  False when unsupported here."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
  except (OSError, AttributeError):
    return False
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  fn.restype = ctypes.c_int
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
    return False
  raise OSError(err, os.strerror(err), b)


@contextlib.contextmanager
def _lock(target: str):
  """An exclusive ``flock`` on a hidden sibling ``.NAME.lock`` (released on exit
  or when the process dies)."""
  import fcntl
  parent, name = os.path.split(target)
  path = os.path.join(parent, f".{name}.lock")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


# Tests set this to exercise the portable two-rename path.
_USE_EXCHANGE = True


def _is_nonempty_error(e: OSError) -> bool:
  return e.errno in (errno.ENOTEMPTY, errno.EEXIST)


def commit_directory(tmp: str, target: str, *, overwrite: bool, may_replace=None) -> None:
  """Moves the complete directory ``tmp`` to ``target`` atomically.

  Without ``overwrite`` the rename fails if ``target`` is a non-empty directory
  (another writer got there first): :class:`FileExistsError`.  With it, the old
  ``target`` is swapped out in one step and deleted; ``may_replace(target)``
  (called just before) may raise to refuse replacing something that is not ours.
  ``tmp`` no longer exists when this returns normally.
  """
  parent = os.path.dirname(target)
  try:
    os.rename(tmp, target)             # absent or empty target: atomic
    _fsync(parent, directory=True)
    return
  except OSError as e:
    if not _is_nonempty_error(e) and not isinstance(e, (IsADirectoryError, NotADirectoryError)):
      raise
    if not overwrite or not os.path.isdir(target):
      raise FileExistsError(f"{target} already exists and is not empty (written meanwhile by "
                            "another process?): choose a new directory or overwrite it") from None
  if may_replace is not None:
    may_replace(target)
  if _USE_EXCHANGE and _renameat2_exchange(tmp, target):
    _fsync(parent, directory=True)
    shutil.rmtree(tmp, ignore_errors=True)     # tmp now holds the previous fold
    return
  # Portable path: move the old one aside and the new one in, under a lock so
  # that overwriting writers take turns; a crash in between leaves the old fold
  # intact as .NAME.old-* beside the target.  A writer whose first, unlocked
  # rename lands in the gap between our two renames is moved aside in turn.
  with _lock(target):
    for _ in range(64):
      old = None
      if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=parent)
        os.rmdir(old)
        try:
          os.rename(target, old)
        except FileNotFoundError:
          old = None
      try:
        os.rename(tmp, target)
      except OSError as e:
        if _is_nonempty_error(e):       # another writer's fold arrived meanwhile
          if old is not None:
            shutil.rmtree(old, ignore_errors=True)
          continue
        if old is not None:
          with contextlib.suppress(OSError):
            os.rename(old, target)
        raise
      _fsync(parent, directory=True)
      if old is not None:
        shutil.rmtree(old, ignore_errors=True)
      return
  raise FileExistsError(f"{target} kept being replaced by other writers; try again")


def default_file_mode() -> int:
  """``0o666`` less the process umask: what ``open(path, "w")`` gives a new file."""
  mask = os.umask(0o022)
  os.umask(mask)
  return 0o666 & ~mask


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes ``path`` through a temporary sibling and ``os.replace``: readers see
  the old file or the new one, never a prefix."""
  path = os.path.abspath(path)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=os.path.dirname(path))
  try:
    os.fchmod(fd, default_file_mode())   # mkstemp's 0600 would become the file's mode
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  _fsync(os.path.dirname(path), directory=True)


# ----------------------------------------------------------------------------
# Keyed integrity (HMAC-SHA256) and snapshot reads.

SIGNATURE = "signature.json"


def key_bytes(key: "bytes | str") -> bytes:
  """A signing key as bytes (a str is UTF-8 encoded); refuses an empty key."""
  if isinstance(key, str):
    key = key.encode()
  if not isinstance(key, (bytes, bytearray)) or not key:
    raise ValueError("a signing key must be non-empty bytes or str (e.g. the contents of a key "
                     "file: `head -c 32 /dev/urandom > key`)")
  return bytes(key)


def hmac_hex(key: "bytes | str", data: bytes) -> str:
  import hmac
  return hmac.new(key_bytes(key), data, hashlib.sha256).hexdigest()


def hmac_matches(key: "bytes | str", data: bytes, mac: object) -> bool:
  import hmac
  return isinstance(mac, str) and hmac.compare_digest(hmac_hex(key, data), mac)


def sign_directory(directory: str, key: "bytes | str") -> None:
  """Writes ``signature.json``: the HMAC-SHA256 of ``manifest.json``'s bytes
  (the manifest holds every file's SHA-256, so the key covers every byte)."""
  with open(os.path.join(directory, MANIFEST), "rb") as f:
    raw = f.read()
  path = os.path.join(directory, SIGNATURE)
  with open(path, "w") as f:
    json.dump({"alg": "hmac-sha256", "manifest": hmac_hex(key, raw)}, f)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())


class _Swapped(Exception):
  """The directory was replaced while it was read: read it again."""


def _read_at(dfd: int, rel: str) -> bytes:
  fd = os.open(rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
  with os.fdopen(fd, "rb") as f:
    return f.read()


def _same_dir(directory: str, dfd: int) -> bool:
  try:
    a, b = os.stat(directory), os.fstat(dfd)
  except OSError:
    return False
  return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _check_signature(dfd: int, directory: str, raw_manifest: bytes, key, what: str) -> None:
  path = os.path.join(directory, SIGNATURE)
  try:
    sig = json.loads(_read_at(dfd, SIGNATURE))
  except FileNotFoundError:
    raise IntegrityError(f"the {what} in {directory} is not signed (no {SIGNATURE}) and a "
                         "verification key was given: refusing it; save it again with "
                         "key=... (`--sign-key FILE`)") from None
  except (ValueError, UnicodeDecodeError, OSError) as e:
    raise IntegrityError(f"{path} is damaged ({type(e).__name__}): refusing the {what}") from None
  mac = sig.get("manifest") if isinstance(sig, dict) else None
  if not hmac_matches(key, raw_manifest, mac):
    raise IntegrityError(f"{path} does not match the manifest under the given key: the {what} in "
                         f"{directory} was modified after it was signed, or signed with another "
                         "key; refusing it")


def _open_dir(directory: str) -> int:
  try:
    return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  except FileNotFoundError:
    raise NotFoundError(f"{directory} does not exist") from None
  except NotADirectoryError:
    raise NotADirectory(f"{directory} is a file, not a saved fold directory") from None


def _manifest_at(dfd: int, directory: str, what: str, key) -> tuple[bytes, dict]:
  try:
    raw = _read_at(dfd, MANIFEST)
  except FileNotFoundError:
    raise NotFoundError(f"{os.path.join(directory, MANIFEST)} does not exist: {directory} is not "
                        f"a {what} (write one with jaxfold.save_fold or `jaxfold fold`)") from None
  manifest = _parse_manifest(raw, directory, what)
  if key is not None:
    _check_signature(dfd, directory, raw, key, what)
  return raw, manifest


def read_verified(directory: str, rels: Iterable[str], *, key=None,
                  what: str = "saved fold") -> dict:
  """``{rel: bytes}`` of small files, read once through one descriptor of
  ``directory`` and checked against its manifest (the bytes checked are the
  bytes returned, even if the directory is replaced meanwhile)."""
  for _ in range(_SNAPSHOT_TRIES):
    dfd = _open_dir(directory)
    try:
      _, manifest = _manifest_at(dfd, directory, what, key)
      out = {}
      for rel in rels:
        want = manifest["files"].get(rel)
        if want is None:
          raise IntegrityError(f"{os.path.join(directory, rel)} is not listed in the manifest of "
                               f"the {what}: {_REDO}")
        try:
          data = _read_at(dfd, rel)
        except FileNotFoundError:
          if not _same_dir(directory, dfd):
            raise _Swapped() from None
          raise IntegrityError(f"{os.path.join(directory, rel)} is missing: {_REDO}") from None
        if len(data) != want.get("bytes") or sha256_bytes(data) != want.get("sha256"):
          raise IntegrityError(f"{os.path.join(directory, rel)} does not match its SHA-256 in the "
                               f"manifest: {_REDO}")
        out[rel] = data
      return out
    except _Swapped:
      continue
    finally:
      os.close(dfd)
  raise IntegrityError(f"{directory} kept being replaced while it was read: try again")


_SNAPSHOT_TRIES = 16
_CHUNK = 1 << 22


def _copy_verified(dfd: int, directory: str, rel: str, want: dict, dest: str) -> None:
  full = os.path.join(directory, rel)
  try:
    fd = os.open(rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
  except FileNotFoundError:
    if not _same_dir(directory, dfd):
      raise _Swapped() from None
    raise IntegrityError(f"{full} is missing: the saved fold in {directory} is incomplete (a "
                         f"partial copy?); {_REDO}") from None
  h, n = hashlib.sha256(), 0
  out = os.path.join(dest, *rel.split("/"))
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with os.fdopen(fd, "rb") as src, open(out, "wb") as dst:
    while True:
      chunk = src.read(_CHUNK)
      if not chunk:
        break
      h.update(chunk)
      n += len(chunk)
      dst.write(chunk)
  if n != want.get("bytes"):
    raise IntegrityError(f"{full} has {n} bytes, {want.get('bytes')} were written: it is "
                         f"truncated or was replaced; {_REDO}")
  if h.hexdigest() != want.get("sha256"):
    raise IntegrityError(f"{full} does not match its SHA-256 in the manifest: its content changed "
                         f"after it was written (disk or copy corruption, or an edit); {_REDO}")


@contextlib.contextmanager
def snapshot(directory: str, *, strict_under: Iterable[str] = (), key=None,
             what: str = "saved fold"):
  """Yields ``(private_dir, manifest)``: a private copy of every file the
  manifest lists, each read once through a descriptor of ``directory``, hashed
  while it is copied, and compared with the manifest.  Whatever replaces
  ``directory`` meanwhile (``save_fold(..., overwrite=True)``), the copy holds
  exactly the verified bytes of one fold; it is removed on exit.  With ``key``
  the manifest's HMAC (``signature.json``) must match too.

  The copy goes to ``tempfile.gettempdir()`` (``TMPDIR``) and needs as much
  space as the fold."""
  strict_under = tuple(strict_under)
  for _ in range(_SNAPSHOT_TRIES):
    dfd = _open_dir(directory)
    priv = tempfile.mkdtemp(prefix="jaxfold-load-")
    try:
      try:
        _, manifest = _manifest_at(dfd, directory, what, key)
        for rel in sorted(manifest["files"]):
          _copy_verified(dfd, directory, rel, manifest["files"][rel], priv)
        for top in strict_under:
          try:
            walker = list(os.fwalk(top, dir_fd=dfd))
          except OSError:
            walker = []
          for root, _dirs, files, _rfd in walker:
            for name in files:
              rel = f"{root}/{name}".replace(os.sep, "/")
              if rel not in manifest["files"]:
                raise IntegrityError(f"{os.path.join(directory, rel)} is not listed in "
                                     f"{os.path.join(directory, MANIFEST)}: the {what} was modified "
                                     f"after it was written (a stray or stale file); remove it or "
                                     f"{_REDO}")
      except _Swapped:
        continue
      yield priv, manifest
      return
    finally:
      os.close(dfd)
      shutil.rmtree(priv, ignore_errors=True)
  raise IntegrityError(f"{directory} kept being replaced while it was read: try again")


# ----------------------------------------------------------------------------
# Temporary directories of writers that died.

STALE_AFTER = 6 * 3600   # seconds: a temporary directory of an unknown writer older than this is dead


def writer_tag() -> str:
  """``<host hash>.<pid>``: who owns a temporary directory (parsed by :func:`remove_stale`)."""
  host = hashlib.sha256(platform.node().encode()).hexdigest()[:8]
  return f"{host}.{os.getpid()}"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OSError):
    return True
  return True


def remove_stale(parent: str, name: str) -> list:
  """Removes ``.NAME.tmp-*`` siblings left by writers that died (their pid on
  this host is gone, or unknown writers after :data:`STALE_AFTER`); returns them."""
  import time
  prefix = f".{name}.tmp-"
  me = writer_tag().split(".")[0]
  removed = []
  try:
    entries = os.listdir(parent)
  except OSError:
    return removed
  for entry in entries:
    if not entry.startswith(prefix):
      continue
    path = os.path.join(parent, entry)
    tag = entry[len(prefix):].split("-")[0]
    host, _, pid = tag.partition(".")
    dead = False
    if host == me and pid.isdigit():
      dead = not _pid_alive(int(pid))
    else:
      with contextlib.suppress(OSError):
        dead = time.time() - os.lstat(path).st_mtime > STALE_AFTER
    if dead and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(entry)
  return removed


_DISK_FULL = ("RESOURCE_EXHAUSTED", "No space left on device", "Disk quota exceeded")


def is_disk_full(e: BaseException) -> bool:
  """An ``OSError`` ENOSPC/EDQUOT, or orbax/tensorstore's wrapped form of one."""
  if isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
    return True
  text = str(e)
  return any(s in text for s in _DISK_FULL)


class DiskFullError(IntegrityError, OSError):
  """The disk (or quota) filled up while a fold or an artifact was written;
  nothing was committed."""
