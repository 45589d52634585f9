"""Errors a user can act on, and the one line the CLI prints for each.

``user_message(e)`` turns an exception into ``error: ...`` text naming the file and the fix, or
None for a bug (which keeps its traceback). Covered: the project's own user errors (ValueError,
FileNotFoundError, RuntimeError and their subclasses carry their explanation), a disk that is
full, read-only or not ours to write (OSError, named by errno), and files that do not parse
(``reading(path, fix)`` wraps a load into CorruptFileError). Notes added to an exception with
``add_note`` (e.g. "the shards written so far are kept") end the line.
"""

from __future__ import annotations

import errno
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["CorruptFileError", "reading", "read_json_object", "as_os_error", "user_message"]

# errno -> what to do about it
_OS_FIXES = {
    errno.ENOSPC: "free some space there, or write to a larger disk",
    errno.EDQUOT: "free some of your quota there, or write elsewhere",
    errno.EROFS: "the file system is read-only: choose a writable directory",
    errno.EACCES: "you may not write there: choose a directory you own, or fix its permissions",
    errno.EPERM: "you may not write there: choose a directory you own, or fix its permissions",
}


class CorruptFileError(ValueError):
    """A file that exists but does not parse: truncated (a cut download or copy) or not what it says."""


def as_os_error(e: BaseException, path: str | Path) -> OSError | None:
    """An I/O failure that a library reported as text (safetensors: ``IoError(Os { code: 28, ...``)
    as the OSError it was, naming ``path``; None if ``e`` is no I/O failure."""
    if isinstance(e, OSError):
        if e.filename is None:
            e.filename = str(path)
        return e
    if m := re.search(r"Os \{ code: (\d+)", str(e)):
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    return None


@contextmanager
def reading(path: str | Path, fix: str) -> Iterator[None]:
    """Loads inside this block that fail to parse ``path`` raise CorruptFileError naming it and ``fix``."""
    try:
        yield
    except CorruptFileError:
        raise
    except Exception as e:
        # ValueError: json, UTF-8, numpy's reshape of a cut GGUF tensor; safetensors has its own type
        if not isinstance(e, (ValueError, EOFError)) and type(e).__name__ != "SafetensorError":
            raise
        # "may": a reader's ValueError can also mean "not supported" (its text, kept, says which)
        raise CorruptFileError(f"{path} cannot be read ({type(e).__name__}: {e}): it may be truncated or "
                               f"corrupt; {fix}") from e


def read_json_object(path: str | Path, fix: str) -> dict:
    """The JSON object (a mapping) in ``path``; CorruptFileError naming ``path`` and ``fix`` when it
    does not parse, holds another JSON value (a list, a string) or is a directory; FileNotFoundError when
    it does not exist (saying so when the "path" is inline JSON)."""
    path = Path(path)
    if not path.exists():
        inline = str(path).lstrip().startswith(("{", "["))
        raise FileNotFoundError(f"{path} does not exist{' (it reads as inline JSON: write it to a file)' if inline else ''}"
                                f"; {fix}")
    if path.is_dir():
        raise CorruptFileError(f"{path} is a directory, not a JSON file; {fix}")
    with reading(path, fix):
        value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise CorruptFileError(f"{path} holds a JSON {type(value).__name__}, not an object "
                               f"({{\"key\": value, ...}}); {fix}")
    return value


def _os_message(e: OSError) -> str | None:
    fix = _OS_FIXES.get(e.errno)
    if fix is None:
        return None
    where = f" writing {e.filename}" if e.filename else ""
    return f"{e.strerror or os.strerror(e.errno)}{where}: {fix}"


def user_message(e: BaseException) -> str | None:
    """The ``error:`` line (without the prefix) for ``e``, or None if it is a bug."""
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
        text = _os_message(e)
        if text is None:
            return None
    elif isinstance(e, (ValueError, RuntimeError, FileNotFoundError)):
        text = str(e)
    else:
        return None
    notes = getattr(e, "__notes__", None) or []
    return "; ".join([text, *notes])
