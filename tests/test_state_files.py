"""The agent's state files: never through a link, refused by name when no agent wrote them."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadmesh.daemon.state_files import BadStateFile, flag_set, read_state_file, set_flag


def test_a_flag_is_a_regular_file_the_agent_creates(tmp_path: Path) -> None:
    flag = tmp_path / "draining"
    assert not flag_set(flag)
    set_flag(flag, True)
    assert flag_set(flag) and flag.is_file()
    set_flag(flag, False)
    assert not flag_set(flag)
    # No state directory (it could not be made, or is a file): no flag either.
    assert not flag_set(tmp_path / "missing" / "draining")
    (tmp_path / "file").write_text("")
    assert not flag_set(tmp_path / "file" / "draining")


def test_a_link_at_a_flag_is_refused_and_never_followed(tmp_path: Path) -> None:
    flag, target = tmp_path / "draining", tmp_path / "target"
    flag.symlink_to(target)
    with pytest.raises(BadStateFile, match="symbolic link"):
        set_flag(flag, True)
    assert not target.exists()
    with pytest.raises(BadStateFile, match=f"{flag}: not a regular file"):
        flag_set(flag)
    set_flag(flag, False)  # removes the link itself
    assert not flag.is_symlink()


def test_state_file_contents_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "version"
    assert read_state_file(path) is None
    path.write_text("12\n")
    assert read_state_file(path) == "12\n"
    path.write_text("1" * 65)
    with pytest.raises(BadStateFile, match="longer than 64 bytes"):
        read_state_file(path)
    path.unlink()
    path.mkdir()
    with pytest.raises(BadStateFile, match="not a regular file"):
        read_state_file(path)
