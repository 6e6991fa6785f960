"""Living under torchrun's elastic agent: permanent errors end the job, restarts cannot replay them
into a hang, and a worker never outlives its agent.

The problem (torch 2.13, `elastic/agent/server/api.py` `_invoke_run`): the agent restarts the whole
worker group after *any* worker failure, up to `--max-restarts` times (the spec's
`rendezvous.maxRestarts`), and it cannot be told that an exit code means "permanent". A
configuration error (exit 2) then comes back on every restart; worse, the restarted workers' gloo
`connectFullMesh` finds the dead workers' addresses in the store ("Connection refused"), the
restart fails with a *retryable* CollectiveTimeout that replaces the ConfigError in the
termination message, and a restart can sit in `init_process_group` until the collective timeout.

What cannot be done: checking the config and inputs before torchrun starts the workers. In the
cluster torchrun is the container's PID 1 (the PyTorchJob's command is `torchrun -m
llamaft_trainer`), so the first code of ours that runs is a worker. torchrun's error file only
feeds its failure summary; it does not stop restarts.

What the trainer does instead, in the worker that hit the ConfigError (`end_job`):
1. It writes the termination message (reason ConfigError, `retryable: false`, `exitCode: 2`), which
   the operator reads as a permanent failure (the pod's exit code is torchrun's 1 whatever we do).
2. It closes the job's rendezvous: the same `RendezvousHandler.set_closed()` an agent calls when it
   gives up (`shutdown()`). The parameters are the agent's own: its command line
   (`/proc/<ppid>/cmdline`) parsed by torchrun's parser, which also reads the PET_* variables the
   Kubeflow training operator sets; the run id is TORCHELASTIC_RUN_ID. Every agent's next
   rendezvous (the restart) then fails at once with RendezvousClosedError and torchrun exits,
   whatever `--max-restarts` says. Bounded by CLOSE_TIMEOUT_S.
3. It exits 2.

If closing was not possible (`--standalone` picks a port we cannot see, a static rendezvous, the
store unreachable), a restart still cannot hang or hide the cause: `replayed_config_error` (run by
`__main__` before torch is even imported) finds this worker group's ConfigError of an earlier
restart in the termination log, keeps that message, tries the close again and exits 2 without
touching the process group, so each remaining restart costs a process start, not a timeout.

`watch_agent`: torchrun starts each worker in its own session, so a signal to the agent's process
group never reaches it. If the agent dies without stopping its workers (SIGKILL), nobody else
will: a worker that sees its parent change exits at once.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llamaft_trainer.process import termination
from llamaft_trainer.process.errors import EXIT_FAILURE

CLOSE_TIMEOUT_S = 30.0
"""At most this long to close the rendezvous (an unreachable store or etcd)."""
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def log(message: str) -> None:
    print(f"llamaft_trainer: rank {os.environ.get('RANK', '0')}: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the agent's rendezvous
def agent_args(pid: int | None = None) -> list[str] | None:
    """torchrun's own arguments, from its command line (None: the parent is not torchrun)."""
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]
    for index, arg in enumerate(argv):
        if arg in _TORCHRUN_MODULES and index > 0 and argv[index - 1] == "-m":
            return argv[index + 1 :]
        if os.path.basename(arg) == "torchrun":
            return argv[index + 1 :]
    return None


def _parse_conf(text: str) -> dict[str, str]:
    """torchrun's `--rdzv-conf k1=v1,k2=v2`."""
    conf = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    return conf


def rendezvous_parameters(timeout_s: float) -> tuple[Any | None, str]:
    """(the agent's RendezvousParameters, or None and why not)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    argv = agent_args()
    # Without a torchrun parent the PET_* variables (torchrun's argument defaults) still describe it.
    argv = argv if argv else ["llamaft_trainer"]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None, "cannot read torchrun's arguments"
    if getattr(args, "standalone", False):
        return None, "torchrun --standalone: its rendezvous port is not known to the workers"
    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        return None, f"rendezvous backend {args.rdzv_backend!r} has nothing to close"
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    conf: dict[str, Any] = {**_parse_conf(args.rdzv_conf), "is_host": False, "read_timeout": max(1, int(timeout_s))}
    params = RendezvousParameters(
        backend=args.rdzv_backend, endpoint=args.rdzv_endpoint, run_id=os.environ.get("TORCHELASTIC_RUN_ID", args.rdzv_id),
        min_nodes=min_nodes, max_nodes=max_nodes, **conf,
    )
    return params, ""


def close_rendezvous(timeout_s: float = CLOSE_TIMEOUT_S) -> tuple[bool, str]:
    """Close this job's rendezvous so that no agent restarts its workers; (closed, what happened).
    Never raises, never takes longer than `timeout_s`."""
    outcome: list[tuple[bool, str]] = []

    def work() -> None:
        try:
            params, why = rendezvous_parameters(timeout_s)
            if params is None:
                outcome.append((False, why))
                return
            from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

            get_rendezvous_handler(params).set_closed()
            outcome.append((True, f"closed torchrun's rendezvous {params.run_id!r} ({params.backend} at {params.endpoint})"))
        except Exception as exc:  # the error path must not fail
            outcome.append((False, f"could not close the rendezvous: {type(exc).__name__}: {exc}"))

    thread = threading.Thread(target=work, name="llamaft-close-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else (False, f"closing the rendezvous took over {timeout_s:.0f} s")


PROBE_TIMEOUT_S = 2.0
"""How long a stopped worker tries to reach its agent's rendezvous store."""
_DEFAULT_PORTS = {"etcd": 2379, "etcd-v2": 2379, "c10d": 29400}


def rendezvous_lost(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """After a SIGTERM under torchrun: why it came from the agent losing its rendezvous store, or
    None (not under torchrun, no store to reach, or the store answers: a real preemption).

    torchrun's agent that loses its store (etcd gone mid-run) raises RendezvousConnectionError and
    SIGTERMs its workers; only its log says so, and the workers' own report would say Preempted. So
    a stopped worker tries the store's address (a TCP connect, at most `timeout_s`): refused or
    unreachable means the agent's error is what stopped it. Never raises."""
    if not under_torchrun():
        return None
    try:
        params, _ = rendezvous_parameters(timeout_s)
        if params is None:
            return None
        endpoint = str(params.endpoint).split(",")[0].strip()
        endpoint = endpoint.split("://", 1)[-1].rstrip("/")
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        port_number = int(port) if port.isdigit() else _DEFAULT_PORTS.get(str(params.backend), 2379)
        import socket

        try:
            socket.create_connection((host.strip("[]"), port_number), timeout=timeout_s).close()
        except OSError as exc:
            return (f"torchrun's agent stopped the workers: its rendezvous store ({params.backend} at {host}:{port_number}) "
                    f"is unreachable ({exc.strerror or type(exc).__name__}; the agent's log says RendezvousConnectionError)")
        return None
    except Exception:  # the stop path must not fail
        return None


def end_job(timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """After a permanent error under torchrun: close the rendezvous, so no restart follows."""
    if not under_torchrun():
        return
    started = time.monotonic()
    closed, what = close_rendezvous(min(timeout_s, CLOSE_TIMEOUT_S))
    took = time.monotonic() - started
    if closed:
        log(f"the configuration error is permanent: {what} in {took:.1f} s, so torchrun restarts nothing "
            "(the RendezvousClosedError it reports next is this)")
    else:
        log(f"the configuration error is permanent, but {what}; a torchrun restart will exit 2 at once")


# ------------------------------------------------------------------ restarts replay a ConfigError
def replayed_config_error() -> dict[str, Any] | None:
    """On a torchrun restart: the ConfigError an earlier restart of this worker group left in the
    termination log (the file is the pod's; every local rank shares it)."""
    restart = restart_count()
    if restart <= 0:
        return None
    doc = termination.read()
    if not doc or doc.get("phase") != "Failed" or doc.get("reason") != termination.CONFIG_ERROR:
        return None
    earlier = doc.get("restartCount")
    return doc if isinstance(earlier, int) and earlier < restart else None


def replay_permanent_error() -> int | None:
    """`__main__`'s first step: the exit code 2 when this start is a restart after a ConfigError
    (the termination message is left as the first failure wrote it), else None."""
    doc = replayed_config_error()
    if doc is None:
        return None
    message = str(doc.get("message", ""))
    print(f"llamaft: configuration error: {message}", file=sys.stderr, flush=True)
    log(f"torchrun restart {restart_count()} after a configuration error of restart {doc.get('restartCount')}: "
        "not starting again (the error is permanent)")
    end_job()
    return int(termination.exit_code(termination.CONFIG_ERROR))


# ------------------------------------------------------------------ never outlive the agent
def watch_agent(interval_s: float = 1.0) -> None:
    """Exit at once if the torchrun agent (this process's parent) dies: nothing else would stop
    this worker (its own session) and it would hold ports, memory and its peers' collectives."""
    if not under_torchrun():
        return
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                log(f"the torchrun agent (pid {parent}) is gone; exiting")
                os._exit(EXIT_FAILURE)

    threading.Thread(target=watch, name="llamaft-watch-agent", daemon=True).start()
