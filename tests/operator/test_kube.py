"""kube.py: the client's credential refresh, at most once per interval."""

from __future__ import annotations

from typing import Any

from llamaft.operator.kube import refresh_at_most_every


def test_the_refresh_hook_runs_at_most_once_per_interval() -> None:
    now = [100.0]
    calls: list[Any] = []
    refresh = refresh_at_most_every(30.0, calls.append, clock=lambda: now[0])
    assert refresh is not None
    for t in (100.0, 100.5, 129.9):
        now[0] = t
        refresh("config")
    assert len(calls) == 1, "the first request refreshes, the next ones within 30 s do not"
    now[0] = 130.0
    refresh("config")
    assert calls == ["config", "config"], "a request after the interval refreshes again"
    assert refresh_at_most_every(30.0, None) is None, "no hook (a static token): nothing to wrap"


def test_the_throttle_survives_the_kubeconfig_loaders_own_hook(tmp_path: Any, monkeypatch: Any) -> None:
    """The real loader: kube_config's hook re-installs itself on every run (`_set_config`), so a
    wrapper that did not put itself back would throttle the first request only. Counted through
    the client's own auth path (`auth_settings`, which every request runs)."""
    import yaml
    from kubernetes import client, config
    from kubernetes.config import kube_config
    from llamaft.operator import kube

    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "secret"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))
    runs: list[int] = []
    real = kube_config.KubeConfigLoader._set_config
    monkeypatch.setattr(kube_config.KubeConfigLoader, "_set_config",
                        lambda self, configuration: (runs.append(1), real(self, configuration))[1])
    default = client.Configuration.get_default_copy()
    try:
        config.load_kube_config(config_file=str(path))
        loaded = len(runs)
        kube.throttle_credential_refresh(seconds=3600.0)
        api = client.ApiClient()
        for _ in range(5):
            assert api.configuration.auth_settings()["BearerToken"]["value"] == "Bearer secret"
        assert len(runs) - loaded == 1, "one refresh in the hour, not one per request"
        assert api.configuration.refresh_api_key_hook is not None
        assert "refresh_at_most_every" in api.configuration.refresh_api_key_hook.__qualname__
    finally:
        client.Configuration.set_default(default)
