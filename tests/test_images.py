"""The images, without a Docker engine: both Dockerfiles pass hadolint, and the operator image's
install command works in a clean virtual environment and brings no torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    proc = subprocess.run([hadolint, "Dockerfile.operator", "Dockerfile.trainer"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_operator_install_command_in_a_clean_venv(tmp_path: Path) -> None:
    dockerfile = (REPO / "Dockerfile.operator").read_text()
    install = re.search(r'pip install "(\.\[operator\])"', dockerfile)
    assert install, "Dockerfile.operator installs the operator extra"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", install.group(1)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = "import importlib.util, llamaft.operator.handlers; print(importlib.util.find_spec('torch') is None)"
    out = subprocess.run([str(python), "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True", "the operator image must not carry torch"
    cli = subprocess.run([str(venv / "bin" / "llamaft"), "validate", str(REPO / "examples" / "llama2-7b.yaml")], capture_output=True, text=True)
    assert cli.returncode == 0 and ": ok (" in cli.stdout


@pytest.mark.slow
def test_trainer_install_command_in_a_clean_venv(tmp_path: Path) -> None:
    """Dockerfile.trainer's RUN line on top of a torch that is already there (the CUDA base image's
    role; here the CPU build): the extra installs and the image's own import check passes."""
    dockerfile = (REPO / "Dockerfile.trainer").read_text()
    run = re.search(r'RUN pip install "(\.\[trainer\])" && python -c "([^"]+)"', dockerfile)
    assert run, "Dockerfile.trainer installs the trainer extra and checks its imports"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    base = subprocess.run([*pip, "torch==2.13.0"], capture_output=True, text=True, timeout=900)
    assert base.returncode == 0, base.stderr[-3000:]
    extra = subprocess.run([*pip, run.group(1)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert extra.returncode == 0, extra.stderr[-3000:]
    check = subprocess.run([str(venv / "bin" / "python"), "-c", run.group(2)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.startswith("2.13.0"), "the extra must not replace the base image's torch"
