"""The trainer process in its world: who it is (runtime: rank, device, mesh), the errors it reports
and its exit codes (errors), the report it leaves when it ends (termination), how it stops on
SIGTERM (preemption) and tears down (shutdown), how it lives under torchrun's agent (restarts),
the test-only faults (faults), a quiet first screen (quiet) and the throw-away etcd of local runs
(local_etcd). The bottom wing: it imports no other."""
