"""One writer per directory: a second is refused naming the first, a dead one's lock is taken over,
and nothing is left behind."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest

from eaglewire.core.locks import LOCK_NAME, DirectoryLocked, directory_lock, file_lock

SRC = str(Path(__file__).resolve().parents[1] / "src")


@contextmanager
def held_elsewhere(directory: Path, name: str = LOCK_NAME):
    """Another process holding ``directory``'s lock until the block ends; yields its pid."""
    code = textwrap.dedent(f"""
        import sys
        from eaglewire.core.locks import directory_lock
        with directory_lock({str(directory)!r}, name={name!r}):
            print("held", flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(30)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "out"
    with held_elsewhere(out) as pid:
        with pytest.raises(DirectoryLocked) as e:
            with directory_lock(out, what=f"--out {out}"):
                pass
        assert e.value.pid == pid
        assert f"pid {pid}" in str(e.value) and f"--out {out}" in str(e.value) and f"kill {pid}" in str(e.value)
    with directory_lock(out):  # free again once the first is done
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    pid = dead_pid()
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "command": "eaglewire prepare"}))  # as after kill -9
    with caplog.at_level(logging.WARNING, logger="eaglewire.core.locks"), directory_lock(out):
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"pid {pid}" in caplog.text and "no longer running" in caplog.text


def test_nothing_is_left_behind(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError, match="failed before writing"), directory_lock(out):
        assert (out / LOCK_NAME).is_file()
        raise RuntimeError("failed before writing")
    assert not (tmp_path / "a").exists()  # the directories the lock made, removed while empty
    with directory_lock(out):
        (out / "data").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == ["data"]  # kept with what was written; no lock file


def test_a_process_may_lock_what_it_holds_again(tmp_path):
    """quickstart holds its folder while the steps it runs lock theirs (or the same) again."""
    with directory_lock(tmp_path), directory_lock(tmp_path):
        pass
    assert not (tmp_path / LOCK_NAME).exists()


def test_locks_of_other_names_do_not_exclude_each_other(tmp_path):
    """torchrun ranks each lock their own part of one --out."""
    with held_elsewhere(tmp_path, name=".eaglewire.rank0-of-2.lock"):
        with directory_lock(tmp_path, name=".eaglewire.rank1-of-2.lock"):
            pass


def test_a_waiting_lock_gets_the_file_once_it_is_free(tmp_path):
    lock = tmp_path / "entry.lock"
    with file_lock(lock, wait=True):
        assert lock.is_file()
    with file_lock(lock, wait=True):
        pass
    assert not lock.exists()
