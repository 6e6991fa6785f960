"""The `llamaft` command's manners: --version, a closed pipe, and `llamaft operator` without credentials."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from llamaft.cli import main as cli
from llamaft.credentials import missing_credentials

from tests.conftest import REPO

LLAMAFT = str(Path(sys.executable).with_name("llamaft"))


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"llamaft {version('llamaft')}\n"


@pytest.mark.parametrize("command", [
    ["plan", "examples/llama2-70b.yaml"],
    ["validate", "examples/tiny.yaml", "examples/llama2-7b.yaml"],
    ["crd"],
])
def test_output_to_a_closed_pipe_ends_quietly_with_status_1(command: list[str]) -> None:
    """`llamaft plan FILE | head -1`: the reader is gone before the output is written. Python's
    recipe (docs.python.org/3/library/signal.html#note-on-sigpipe): no traceback, exit status 1."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([LLAMAFT, *command], stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def _no_credentials(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))


def test_the_operator_without_credentials_says_so_in_one_line_before_kopf_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _no_credentials(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "kopf", None)  # reaching kopf at all fails the test (ImportError)
    assert cli(["operator", "--standalone"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert "KUBECONFIG" in lines[0] and "service account" in lines[0] and str(tmp_path / ".kube" / "config") in lines[0]


def test_credentials_are_a_kubeconfig_file_or_the_service_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = tmp_path / "token"
    absent = tmp_path / "absent-token"
    assert missing_credentials({"HOME": str(tmp_path)}, absent) is not None
    config = tmp_path / "config"
    config.write_text("apiVersion: v1\nkind: Config\n")
    listed = os.pathsep.join([str(tmp_path / "other"), str(config)])  # KUBECONFIG may list several files
    assert missing_credentials({"HOME": str(tmp_path), "KUBECONFIG": listed}, absent) is None
    assert "KUBECONFIG" in str(missing_credentials({"KUBECONFIG": str(tmp_path / "other")}, absent))
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("apiVersion: v1\n")
    assert missing_credentials({"HOME": str(tmp_path)}, absent) is None, "~/.kube/config"
    token.write_text("t")
    pod = {"HOME": str(tmp_path / "nohome"), "KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert missing_credentials(pod, token) is None, "in a pod, the service account"
    assert missing_credentials({**pod, "KUBERNETES_SERVICE_HOST": ""}, token) is not None
