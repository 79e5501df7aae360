"""The KV tiers' key: a server secret that signs every record and never goes into a tier.

    default:   $XDG_STATE_HOME/kvlm/tier.key (else ~/.local/state/kvlm/tier.key),
               32 random bytes, created 0600 on first use, exclusively (a second server
               starting at the same moment reads the first one's key, never a half-written
               one)
    explicit:  `kvlm serve --kv-tier-key FILE` (EngineConfig.kv_tier_key): replicas on
               several machines that share one tier give each the same file

Either way the file must be a regular file of the user's that no one else may read or
write, holding at least 16 bytes: else one line says what is wrong and how to fix it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from kvlm.errors import InvalidRequestError

KEY_BYTES = 32  # a new key
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096  # a key file larger than this is not a key


def load_tier_key(path: str | Path | None = None) -> bytes:
    """The key in `path`, or in the default file (made on first use) when None."""
    if path is None:
        state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        path = Path(state) / "kvlm" / "tier.key"
        _create(path)
        return _read(path, follow=False)
    return _read(Path(path).expanduser(), follow=True)


def _create(path: Path) -> None:
    """Write a new key to `path` unless one is there. The key is written to a private
    temporary file and linked into place: link() fails on an existing name (an exclusive
    create, as O_EXCL) and publishes the whole key at once."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        return
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)
    except FileExistsError:
        pass  # another server made it first: theirs is the key
    finally:
        os.unlink(tmp)


def _read(path: Path, follow: bool) -> bytes:
    """The key bytes, once the file is checked private. An explicit path may be a symlink
    (a mounted secret usually is); the default one, which kvlm made, may not."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InvalidRequestError(
            f"KV tier key {path} does not exist; make one with: "
            f"head -c 32 /dev/urandom > {path} && chmod 600 {path}"
        ) from None
    except OSError as exc:
        raise InvalidRequestError(f"KV tier key {path}: {exc.strerror}") from None
    try:
        _check_private(path, os.fstat(fd))
        key = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidRequestError(
            f"KV tier key {path} holds {len(key)} bytes; a key is "
            f"{MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes (head -c 32 /dev/urandom > {path})"
        )
    return key


def _check_private(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not you (uid {os.getuid()}); use a key of your own"
    elif st.st_mode & 0o077:
        problem = (
            f"can be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}), who "
            f"could forge tier records; fix with chmod 600 {path}"
        )
    else:
        return
    raise InvalidRequestError(f"KV tier key {path} {problem}")
