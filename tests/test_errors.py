"""What the CLI says when the disk, the file system or a file is at fault: one ``error:`` line
naming the file and the fix, exit 2, no traceback."""

from __future__ import annotations

import errno

import pytest

from eaglewire.core.errors import CorruptFileError, reading, user_message


def test_os_errors_name_the_file_and_the_fix():
    full = OSError(errno.ENOSPC, "No space left on device", "/data/shard-00003.safetensors.tmp")
    full.add_note("the shards written so far are kept: run the same command again to resume")
    text = user_message(full)
    assert text.startswith("No space left on device writing /data/shard-00003.safetensors.tmp: free some space")
    assert text.endswith("run the same command again to resume")
    assert "read-only" in user_message(OSError(errno.EROFS, "Read-only file system", "/ro/x"))
    assert user_message(OSError(errno.EIO, "Input/output error")) is None  # not the user's to fix: a traceback
    assert user_message(KeyError("x")) is None
    assert user_message(ValueError("--x must be > 0, got -1")) == "--x must be > 0, got -1"


def test_reading_names_the_file_that_does_not_parse(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text('{"cut": ')
    with pytest.raises(CorruptFileError, match=rf"{path} cannot be read \(JSONDecodeError.*truncated or corrupt; copy it again"):
        with reading(path, "copy it again"):
            json.loads(path.read_text())
    with pytest.raises(KeyError), reading(path, "copy it again"):  # not a parse failure: left alone
        raise KeyError("bug")
