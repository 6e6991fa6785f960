"""`llamaft sweep FILE --workers 1,2,4,8,16 --max-steps N`: the reference blog's scaling chart, made
by the product instead of by hand.

The same fine-tune is run at each size (plan.py: one LlamaFineTune per size, its own name,
labels and checkpoint directory, checked as the API server and the operator would before anything
starts), each run's final report is collected (the trainer's `performance`, which the operator
keeps in `status.performance`), and the table (stdout, CSV, JSON) and a PNG chart of throughput
and scaling efficiency against ideal linear scaling are written (report.py, chart.py).

Where the sizes run: on a cluster (cluster.py: the runs are created through the Kubernetes API
and the operator runs them, one after another by default so they do not compete for GPUs, or all
at once), or here (on_this_machine.py: `llamaft run --local` per size, for the sizes this machine holds).
"""

from __future__ import annotations

from llamaft.sweep.point import Point
from llamaft.sweep.report import write_outputs
from llamaft.sweep.runs import SweepError, SweepPlan, plan_sweep

__all__ = ["Point", "SweepError", "SweepPlan", "plan_sweep", "write_outputs"]
