"""The images, without a Docker engine: both Dockerfiles pass hadolint, install with the one
constraints file CI installs from (and the trainer image's base is the torch release CI tests), the
constraints pin everything CI installs, and each image's install command works in a clean virtual
environment (the operator's brings no torch). Those installs pass --no-compile (the images: --compile-bytecode): what is checked is
that the command resolves and installs with the constraints and that the image's imports work,
not the byte-compilation of a few thousand files that would double their time.

    .venv/bin/python -m tests.test_images --write-constraints   # rewrite constraints.txt from .venv
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

CONSTRAINTS = REPO / "constraints.txt"
EXTRAS = ("operator", "trainer", "sweep", "dev")
HEADER_LINES = 7


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """constraints.txt as {canonical name: version}; every line is `name==version`."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: not an exact pin: {line!r}"
            out[canonicalize_name(name)] = version
    return out


def installed_closure(root: str = "llamaft", extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """Every distribution `root[extras]` needs, transitively, with the installed versions (local
    labels such as +cpu dropped: the CUDA image's torch has another)."""
    found: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in done:
            continue
        done.add((canonicalize_name(name), wanted))
        for text in metadata.distribution(name).requires or []:
            req = Requirement(text)
            envs = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            found[canonicalize_name(req.name)] = Version(metadata.version(req.name)).public
            todo.append((req.name, frozenset(req.extras)))
    return found


def _dockerfile(name: str) -> str:
    return (REPO / name).read_text()


def test_constraints_pin_exactly_what_ci_installs() -> None:
    """Nothing floats: every package llamaft[operator,trainer,sweep,dev] pulls in is pinned, the file
    holds nothing else, and the environment the tests run in has exactly those versions (CI's
    .ci/setup installs from the file; a package upgraded by hand fails here, not in an image)."""
    want, have = pins(), installed_closure()
    assert sorted(set(have) - set(want)) == [], "unpinned dependencies: add them to constraints.txt"
    assert sorted(set(want) - set(have)) == [], "pins of packages nothing installs: remove them"
    differ = {name: (have[name], want[name]) for name in have if Version(have[name]) != Version(want[name])}
    assert differ == {}, "installed != pinned (installed, pinned): reinstall with bash .ci/setup or rewrite the file"


def test_images_and_ci_install_from_the_constraints() -> None:
    """The trainer image's base is the CUDA build of the torch CI tests; both images and .ci/setup
    install with -c constraints.txt; the operator image runs the Python CI runs."""
    want = pins()
    trainer, operator = _dockerfile("Dockerfile.trainer"), _dockerfile("Dockerfile.operator")
    base = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime$", trainer, re.M)
    assert base, "Dockerfile.trainer's default base image is an official pytorch/pytorch CUDA runtime tag"
    assert base.group(1) == want["torch"], f"base image torch {base.group(1)} != constraints.txt torch {want['torch']}"
    for name, text, extra in (("Dockerfile.trainer", trainer, "trainer"), ("Dockerfile.operator", operator, "operator")):
        assert re.search(r"^COPY [^\n]*\bconstraints\.txt\b[^\n]* \./$", text, re.M), f"{name} copies constraints.txt"
        installs = re.findall(r"pip install ([^\n&\\]*)", text)
        assert [i.strip() for i in installs] == ["uv==0.13.9", f'--system --compile-bytecode -c constraints.txt ".[{extra}]"'], (name, installs)
    python = re.search(r"^FROM python:(\d+\.\d+)-slim$", operator, re.M)
    assert python and python.group(1) == f"{sys.version_info.major}.{sys.version_info.minor}", "operator image Python != CI's"
    setup = (REPO / ".ci" / "setup").read_text()
    assert "CONSTRAINTS=constraints.txt" in setup and '-c "$CONSTRAINTS" -e' in setup
    assert not re.search(r"torch==\d", setup), ".ci/setup takes torch's version from constraints.txt"


def test_constraints_are_what_the_writer_writes() -> None:
    assert CONSTRAINTS.read_text() == render_constraints(pins()), "rewrite with --write-constraints"


def render_constraints(versions: dict[str, str]) -> str:
    header = "".join(CONSTRAINTS.read_text().splitlines(keepends=True)[:HEADER_LINES])
    return header + "".join(f"{name}=={versions[name]}\n" for name in sorted(versions))


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    proc = subprocess.run([hadolint, "Dockerfile.operator", "Dockerfile.trainer"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


UV = re.compile(r'pip install (uv==[0-9.]+) && uv pip install --system --compile-bytecode -c (constraints\.txt) "(\.\[\w+\])"')
"""An image's install: pip installs the pinned uv, uv installs the extra with the constraints."""


def image_install(venv: Path, command: re.Match[str], cwd: Path = REPO) -> None:
    """The image's install command into `venv`: `--system` (the image's base interpreter) becomes
    `--python` of the venv, never this machine's own Python."""
    python = venv / "bin" / "python"
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "UV_NO_CACHE": "1"}
    uv = subprocess.run([str(python), "-m", "pip", "install", "-q", command.group(1)], capture_output=True, text=True, timeout=300)
    assert uv.returncode == 0, uv.stderr[-3000:]
    assert str(subprocess.run([str(venv / "bin" / "uv"), "--version"], env=env, capture_output=True, text=True).stdout).startswith(
        f"uv {command.group(1).split('==')[1]}")
    proc = subprocess.run([str(venv / "bin" / "uv"), "pip", "install", "--python", str(python), "--quiet", "--no-compile", "-c", command.group(2), command.group(3)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_images_install_with_the_uv_ci_sets_up_with() -> None:
    """CI (.ci/setup) and both images install with the same pinned uv."""
    pinned = re.search(r"^UV_VERSION=([0-9.]+)$", (REPO / ".ci" / "setup").read_text(), re.M)
    assert pinned, ".ci/setup pins uv (UV_VERSION=...)"
    for name in ("Dockerfile.operator", "Dockerfile.trainer"):
        install = UV.search((REPO / name).read_text())
        assert install, f"{name} installs its extra by the pinned uv with the constraints"
        assert install.group(1) == f"uv=={pinned.group(1)}", f"{name} pins {install.group(1)}, .ci/setup uv=={pinned.group(1)}"


@pytest.mark.slow
def test_operator_install_command_in_a_clean_venv(tmp_path: Path) -> None:
    install = UV.search((REPO / "Dockerfile.operator").read_text())
    assert install and install.group(3) == ".[operator]", "Dockerfile.operator installs the operator extra with the constraints"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    image_install(venv, install)
    check = "import importlib.util, llamaft.operator.handlers; print(importlib.util.find_spec('torch') is None)"
    out = subprocess.run([str(python), "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True", "the operator image must not carry torch"
    cli = subprocess.run([str(venv / "bin" / "llamaft"), "validate", str(REPO / "examples" / "llama2-7b.yaml")], capture_output=True, text=True)
    assert cli.returncode == 0 and ": ok (" in cli.stdout


@pytest.mark.slow
def test_trainer_install_command_in_a_clean_venv(tmp_path: Path) -> None:
    """Dockerfile.trainer's RUN line on top of a torch that is already there (the CUDA base image's
    role; here PyPI's build of the pinned torch): the extra installs and the image's own import check passes."""
    dockerfile = (REPO / "Dockerfile.trainer").read_text()
    install = UV.search(dockerfile)
    imports = re.search(r'uv pip install [^&]+ && python -c "([^"]+)"', dockerfile)
    assert install and install.group(3) == ".[trainer]" and imports, \
        "Dockerfile.trainer installs the trainer extra with the constraints and checks its imports"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The base image's torch: the pinned build, by the project's uv from its cache (.ci/setup filled
    # it), as files, not a download; only the image's own command below runs without a cache.
    uv = Path(sys.executable).with_name("uv")
    base = subprocess.run([str(uv), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
                           "-c", str(CONSTRAINTS), f"torch=={pins()['torch']}"], capture_output=True, text=True, timeout=900)
    assert base.returncode == 0, base.stderr[-3000:]
    image_install(venv, install)
    check = subprocess.run([str(venv / "bin" / "python"), "-c", imports.group(1)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.startswith(pins()["torch"]), "the extra must not replace the base image's torch"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-constraints"]:
        sys.exit(__doc__)
    CONSTRAINTS.write_text(render_constraints(installed_closure()))
    print(f"wrote {CONSTRAINTS}")
