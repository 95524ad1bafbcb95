"""Progress bars: shown on a terminal or when asked, silent in logs and pipes."""

import io

import pytest

from bytelatent import progress as progress_module
from bytelatent.progress import Progress, progress_enabled


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_follows_whether_stderr_is_a_terminal(monkeypatch):
    monkeypatch.setattr(progress_module.sys, "stderr", io.StringIO())
    assert not progress_enabled("auto")
    monkeypatch.setattr(progress_module.sys, "stderr", FakeTerminal())
    assert progress_enabled("auto")
    assert progress_enabled("on") and not progress_enabled("off")
    with pytest.raises(ValueError, match="progress mode"):
        progress_enabled("loud")


def test_bar_when_on_and_nothing_when_auto_off_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", err)
    with Progress("counting", total=4, unit="doc", mode="auto") as bar:
        bar.update(4)
    assert err.getvalue() == ""
    with Progress("counting", total=4, unit="doc", mode="on") as bar:
        bar.update(4)
    assert "counting" in err.getvalue() and "4/4" in err.getvalue()
