"""The render layer: spec -> the Kubernetes objects of a LlamaFineTune, and their admission check.

Pure functions (no API calls, no clock, no randomness), below the operator (llamaft.operator) and
above the API (llamaft.api): `naming` (names and labels), `desired` (ConfigMap, managed etcd,
PyTorchJob), `trainjob` (the Kubeflow Trainer v2 TrainJob), `monitoring` (PodMonitor, alerts,
dashboard), `podmerge` (the pod template overrides' strategic merge) and `admission` (what the API
server cannot check at admission: every rendered object against the cluster's schemas and rules).
The operator, the CLI and the local runner all render through here; ARCHITECTURE.md has the layers.
"""
