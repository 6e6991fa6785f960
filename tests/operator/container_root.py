"""Run one simulated container (tests/operator/sim.py) in a private filesystem, as a container runtime
would: `python -I container_root.py --root DIR [--bind SRC DST] [--bind-ro SRC DST] [--cwd DIR] -- ARGV...`.

Why: the simulated kubelet runs each container as a process tree on this machine. Without a root
of its own, a file the trainer writes outside every volume (a checkpoint on a path no claim backs)
would outlive the container and the pod, which on a real node it never does. Here each container
start gets
- its own mount namespace (unshare(CLONE_NEWNS), every mount made private, so nothing it mounts is
  seen by the host or by another container);
- a root that is an overlayfs: lowerdir `/` (this machine's filesystem plays the image, read
  through), upperdir and workdir `DIR/upper`, `DIR/work` (the container's writable layer: everything
  it writes outside a volume lands there, and the sim deletes DIR when the container is replaced or
  its pod is gone), mounted on `DIR/rootfs`;
- /proc and /sys: recursive binds of the host's; /dev: a fresh tmpfs with the usual device nodes
  (null, zero, full, random, urandom, tty, any /dev/nvidia*: binds of the host's), /dev/pts, the
  fd/stdin/stdout/stderr links and /dev/shm, a private tmpfs of its own (what containerd gives every
  pod; llamaft's pods mount an emptyDir of medium Memory there). A fresh /dev, not a bind of the
  host's, so that the kubelet's file mounts under /dev (the termination log) never create files
  in the host's /dev;
- the volumes: `--bind SRC DST` (a claim's folder, an emptyDir's pod-level folder, the kubelet's
  termination-log file at terminationMessagePath) and `--bind-ro` (configMap volumes, readOnly
  mounts) at DST inside the root, mount points created in the writable layer, shallowest first so
  that nested mount paths stack as the kubelet stacks them;
then chroot into it, chdir to `--cwd` (the container's workingDir; created when missing, as
containerd does; default `/`) and exec ARGV with this process's environment. The exec keeps the
pid, so the sim's `proc.pid` is the container's first process, `setpriv --pdeathsig` (the sim's
`_die_with_parent`, which execs this script) still applies, and the env var marking a container's
processes (sim.MARKER) is inherited by everything it starts.

Needs root (CAP_SYS_ADMIN): SimCluster.start runs `probe` and refuses to start without it; there
is no fallback to the shared filesystem. Standard library only, and run with `python -I`, so that
the container's PYTHONPATH never reaches this script.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import sys
from pathlib import Path, PurePosixPath

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""The device nodes every OCI runtime creates in a container's /dev (runtime-spec config-linux.md
"Default Devices"), bound from the host's."""
EXIT_LAUNCH_FAILED = 128
"""Exit code when the root cannot be built or ARGV cannot be exec'd (the sim reports it as a
container that failed to start)."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2), raising OSError with what was mounted where."""
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {source or fstype} on {target}")


MAX_SYMLINKS = 40
"""Linux's limit on symlinks followed while resolving one path (ELOOP past it)."""


def _inside(root: Path, path: str) -> Path:
    """`path` (absolute, as the container sees it) under the new root, its symlinks resolved as the
    container would read them: an absolute link is read from the new root, and `..` never leaves it
    (runc's securejoin does the same for mount targets). Without this a mount path through such a
    link (Debian's /var/run -> /run: the ServiceAccount token's /var/run/secrets/...) would be made,
    and mounted, on the host's path."""
    if not path.startswith("/"):
        raise ValueError(f"mount path {path!r} must be absolute")
    parts = list(PurePosixPath(path).parts[1:])
    current, followed = root, 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent if current != root else root
            continue
        candidate = current / part
        if candidate.is_symlink():
            followed += 1
            if followed > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, f"too many symlinks resolving {path!r} in the container's root")
            link = PurePosixPath(os.readlink(candidate))
            if link.is_absolute():
                current, parts = root, [*link.parts[1:], *parts]
            else:
                parts = [*link.parts, *parts]
            continue
        current = candidate
    return current


def _mount_point(target: Path, like: Path) -> None:
    """An empty directory or file at `target` to mount `like` (a directory or a file) on."""
    if like.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.touch()


def bind(source: Path, target: Path, *, read_only: bool = False) -> None:
    """A recursive bind of `source` at `target` (read-only: remounted so, as the kubelet does for
    readOnly volumeMounts and configMap volumes)."""
    if not source.exists():
        raise FileNotFoundError(errno.ENOENT, f"bind source {source} does not exist")
    _mount_point(target, source)
    mount(str(source), str(target), None, MS_BIND | MS_REC)
    if read_only:
        mount(None, str(target), None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _overlay_option(path: Path) -> str:
    text = str(path)
    if any(c in text for c in ",:\\"):
        raise ValueError(f"{text!r}: overlayfs options cannot carry ',', ':' or '\\' in a layer path")
    return text


def private_root(root_dir: Path) -> Path:
    """Unshare the mount namespace and mount the overlay root with /proc, /sys and /dev; returns it."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted from here on propagates to the host
    upper, work, rootfs = root_dir / "upper", root_dir / "work", root_dir / "rootfs"
    for folder in (upper, work, rootfs):
        folder.mkdir(parents=True, exist_ok=True)
    mount("overlay", str(rootfs), "overlay", 0,
          f"lowerdir=/,upperdir={_overlay_option(upper)},workdir={_overlay_option(work)}")
    for name in ("proc", "sys"):
        bind(Path("/") / name, rootfs / name)
    dev = rootfs / "dev"
    dev.mkdir(exist_ok=True)
    mount("tmpfs", str(dev), "tmpfs", MS_NOSUID, "mode=755")
    nodes = [Path("/dev") / n for n in DEVICES] + sorted(Path("/dev").glob("nvidia*"))
    for node in nodes:
        if node.exists() and not node.is_dir():
            bind(node, dev / node.name)
    if Path("/dev/pts").is_dir():
        bind(Path("/dev/pts"), dev / "pts")
        os.symlink("pts/ptmx", dev / "ptmx")
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, dev / link)
    (dev / "shm").mkdir()
    mount("shm", str(dev / "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    return rootfs


def run(root_dir: Path, binds: list[tuple[str, str, bool]], cwd: str, argv: list[str]) -> None:
    """Build the container's root, enter it and exec argv (never returns on success)."""
    rootfs = private_root(root_dir)
    for src, dst, ro in sorted(binds, key=lambda m: len(Path(m[1]).parts)):
        bind(Path(src), _inside(rootfs, dst), read_only=ro)
    os.chroot(rootfs)
    Path(cwd).mkdir(parents=True, exist_ok=True)
    os.chdir(cwd)
    os.execv(argv[0], argv)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run ARGV in a private container filesystem (see the module docstring).")
    parser.add_argument("--root", type=Path, required=True, help="the container's folder: upper/, work/, rootfs/ are made in it")
    parser.add_argument("--bind", nargs=2, action="append", default=[], metavar=("SRC", "DST"), help="a read-write volume")
    parser.add_argument("--bind-ro", nargs=2, action="append", default=[], metavar=("SRC", "DST"), help="a read-only volume")
    parser.add_argument("--cwd", default="/", help="the container's workingDir")
    parser.add_argument("argv", nargs="+", help="the command, after --; argv[0] an absolute path")
    opts = parser.parse_args(args)
    binds = [(s, d, False) for s, d in opts.bind] + [(s, d, True) for s, d in opts.bind_ro]
    if not opts.argv[0].startswith("/"):
        print(f"container_root: {opts.argv[0]!r} must be an absolute path (the kubelet resolves it first)", file=sys.stderr)
        return EXIT_LAUNCH_FAILED
    try:
        run(opts.root.resolve(), binds, opts.cwd, opts.argv)
    except (OSError, ValueError) as exc:
        print(f"container_root: cannot start the container: {exc}", file=sys.stderr)
        return EXIT_LAUNCH_FAILED
    return EXIT_LAUNCH_FAILED  # not reached: execv replaced this process


if __name__ == "__main__":
    sys.exit(main())
