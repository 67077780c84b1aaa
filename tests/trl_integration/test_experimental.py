"""The experimental packages warn once at import (as ``trl.experimental``); one variable silences them.

Here, in this process, how the variable is read. That the stable faces do not warn, each package warns once and the
variable silences them needs a fresh interpreter (a warning given once per process): test_fresh_interpreter.py.
"""

from __future__ import annotations

from trl_integration.experimental import SILENCE_VARIABLE, warn_experimental


def test_the_variable_is_read_at_each_warning(monkeypatch, recwarn):
    """In this process: the variable's accepted spellings silence, anything else does not, and a package warns once."""
    monkeypatch.setattr("trl_integration.experimental._warned", set())
    for value in ("1", "true", "YES "):
        monkeypatch.setenv(SILENCE_VARIABLE, value)
        warn_experimental("some.package")
    assert not recwarn.list
    monkeypatch.setenv(SILENCE_VARIABLE, "0")
    warn_experimental("some.package")
    warn_experimental("some.package")
    assert [str(w.message).split(":")[0] for w in recwarn.list] == ["some.package is experimental"]
