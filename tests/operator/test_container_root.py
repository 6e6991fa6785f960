"""container_root's mount targets resolve inside the container's root, as the container reads its
paths (unit tier: no mount is made)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.operator.container_root import _inside


def test_an_absolute_symlink_is_read_from_the_new_root(tmp_path: Path) -> None:
    """Debian's /var/run -> /run: the ServiceAccount token's mount path goes to the root's /run,
    never to the host's."""
    (tmp_path / "var").mkdir()
    (tmp_path / "run").mkdir()
    os.symlink("/run", tmp_path / "var" / "run")
    target = _inside(tmp_path, "/var/run/secrets/kubernetes.io/serviceaccount")
    assert target == tmp_path / "run" / "secrets" / "kubernetes.io" / "serviceaccount"


def test_relative_links_and_dotdot_stay_inside(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    os.symlink("../../../etc", tmp_path / "a" / "up")
    assert _inside(tmp_path, "/a/up/hosts") == tmp_path / "etc" / "hosts"
    assert _inside(tmp_path, "/../../x") == tmp_path / "x"
    assert _inside(tmp_path, "/a/./b") == tmp_path / "a" / "b"


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    os.symlink("/loop", tmp_path / "loop")
    with pytest.raises(OSError, match="too many symlinks"):
        _inside(tmp_path, "/loop/x")


def test_a_relative_mount_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be absolute"):
        _inside(tmp_path, "relative/path")
