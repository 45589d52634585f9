"""What vLLM's and SGLang's installs share: the record accepted only when complete and for the release, a python
asked what it holds, and apt-get retried after fetching the package lists a fresh machine lacks."""

from __future__ import annotations

import json
import sys

import pytest

from eaglewire.engines.serving import engine_venv
from eaglewire.engines.serving.engine_venv import EngineHome, apt_install, probe_python


class Boom(RuntimeError):
    pass


def test_a_record_is_accepted_only_complete_and_for_this_release(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_venv, "cache_dir", lambda: tmp_path)
    home = EngineHome("thing", "1.2", "eaglewire-thing.json", 3)
    assert home.venv_python() == tmp_path / "engines" / "thing-1.2" / "venv" / "bin" / "python"
    home.install_dir().mkdir(parents=True)
    good = {"record_version": 3, "version": "1.2", "smoke": "served", "python": sys.executable}
    for record, ok in ((good, True), ({**good, "smoke": None}, False), ({**good, "version": "1.1"}, False),
                       ({**good, "record_version": 2}, False), ({**good, "python": "/nowhere"}, False)):
        home.record_path().write_text(json.dumps(record))
        assert (home.read_record() is not None) == ok, record
    home.record_path().write_text("{cut")
    assert home.read_record() is None
    with home.locked() as root:
        assert root == home.install_dir()


def test_probe_python_reads_the_last_line_and_names_a_python_that_fails():
    assert probe_python(sys.executable, "print('noise'); print('{\"a\": 1}')", error=Boom, asked="x") == {"a": 1}
    with pytest.raises(Boom, match="exit 3.*\nask me"):
        probe_python(sys.executable, "import sys; sys.exit(3)", error=Boom, asked="ask me")
    with pytest.raises(Boom, match="does not run"):
        probe_python("/no/python", "", error=Boom, asked="ask me")


def test_apt_install_fetches_the_package_lists_once_it_fails(tmp_path, monkeypatch):
    ran = []

    def run(cmd, logfile, stage, progress, *, error, timeout):
        ran.append(cmd[1])
        if cmd[1] == "install" and ran.count("install") == 1:
            raise error("E: Unable to locate package")

    monkeypatch.setattr(engine_venv, "run_logged", run)
    apt_install("libfoo-dev", "why", tmp_path / "log", lambda s, p: None, error=Boom)
    assert ran == ["install", "update", "install"]
