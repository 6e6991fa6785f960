"""What a run tells the world: the structured log line (logline), metrics, MFU and the progress
document and its server (metrics), Kubeflow Trainer's status (kubeflow_progress), the experiment
trackers (tracking) and the phase timers (profiling)."""
