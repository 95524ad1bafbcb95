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


def test_bar_when_on_and_one_start_line_when_auto_off_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", err)
    with Progress("counting", total=4, unit="doc", mode="auto") as bar:
        bar.update(4)
    assert err.getvalue() == "counting: started\n"  # quick work: no bar, no more lines
    err.truncate(0)
    err.seek(0)
    with Progress(
        "evaluating", mode="lines"
    ) as bar:  # library callers (in-loop eval): no start line
        bar.update(4)
    assert err.getvalue() == ""
    with Progress("counting", total=4, unit="doc", mode="on") as bar:
        bar.update(4)
    assert "counting" in err.getvalue() and "4/4" in err.getvalue()


def test_auto_off_a_terminal_writes_a_line_at_the_start_and_every_interval(monkeypatch):
    """Long work in a log file is never silent: a line as it starts, one per LINE_EVERY_S, and
    one at the end."""
    err = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", err)
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    with Progress("preprocessing", unit="doc", mode="auto") as bar:
        assert err.getvalue() == "preprocessing: started\n"
        bar.update(3)
        assert err.getvalue() == "preprocessing: started\n"  # nothing more before the interval
        now[0] += progress_module.LINE_EVERY_S
        bar.update(3)
        now[0] += 1
        bar.update(1)  # a second later: still one line
    lines = err.getvalue().splitlines()
    assert lines == [
        "preprocessing: started",
        "preprocessing: 6 doc in 30 s (0.2/s)",
        "preprocessing: 7 doc in 31 s (0.2/s), done",
    ]
    err.truncate(0)
    with Progress("quiet", mode="off") as bar:
        now[0] += 1000
        bar.update(5)
    assert err.getvalue() == ""
