"""Whether this process has Kubernetes credentials at all, asked before `llamaft operator` starts kopf.

Without any, kopf's login handler (operator/startup.py `login`) fails, kopf logs the traceback and
retries the login every minute forever: a person who ran `llamaft operator` on a laptop without a
cluster sees tracebacks instead of the one thing to fix. The places looked at are the kubernetes
client's own, in the order `startup.login` tries them (kubernetes 37.0.2):
- in the cluster: `config/incluster_config.py` (`InClusterConfigLoader._load_config`) needs the
  KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT variables and the service account's token
  file, /var/run/secrets/kubernetes.io/serviceaccount/token;
- a kubeconfig: `config/kube_config.py` reads KUBE_CONFIG_DEFAULT_LOCATION =
  `os.environ.get('KUBECONFIG', '~/.kube/config')`, a path list (os.pathsep) when KUBECONFIG holds
  several (`KubeConfigMerger`, which skips the files that do not exist).
Only presence is checked: whether the credentials are valid is the API server's answer, which kopf
reports (and retries) as before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SERVICE_TOKEN_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_PORT_ENV = "KUBERNETES_SERVICE_PORT"
DEFAULT_KUBECONFIG = "~/.kube/config"


def kubeconfig_files(environ: Mapping[str, str]) -> list[Path]:
    """The kubeconfig files the client would read (KUBECONFIG's list, else ~/.kube/config)."""
    text = environ.get("KUBECONFIG", DEFAULT_KUBECONFIG)
    home = environ.get("HOME")
    paths = []
    for part in text.split(os.pathsep):
        if not part:
            continue
        if part.startswith("~") and home:
            part = home + part[1:]
        paths.append(Path(part).expanduser())
    return paths


def missing_credentials(environ: Mapping[str, str], token_file: Path = SERVICE_TOKEN_FILE) -> str | None:
    """None when the process has a service account (in a pod) or a kubeconfig file; otherwise one
    line saying what was looked for and how to give it."""
    if environ.get(SERVICE_HOST_ENV) and environ.get(SERVICE_PORT_ENV) and token_file.is_file():
        return None
    files = kubeconfig_files(environ)
    if any(path.is_file() for path in files):
        return None
    looked = ", ".join(str(p) for p in files) or "(empty)"
    source = "KUBECONFIG" if "KUBECONFIG" in environ else "the default kubeconfig"
    return (f"no Kubernetes credentials: not in a cluster (no service account token at {token_file}, or "
            f"{SERVICE_HOST_ENV} unset) and no kubeconfig file ({source}: {looked}). Set KUBECONFIG to a "
            f"kubeconfig file (kubectl config view works with it), or run the operator in a pod with its service "
            f"account (the Helm chart)")
