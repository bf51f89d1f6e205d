"""Where tandem's per-machine cache lives."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.workers.cache_dir import cache_dir


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tandem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tandem"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "t"))
    assert cache_dir() == tmp_path / "t"
