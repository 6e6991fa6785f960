"""Not a module of its own: the operator's metrics are operator_metrics.py. This name stays only for
step.py's `from llamaft.operator.metrics import RETRIES` (step.py is being reworked elsewhere);
delete this file when that line imports from llamaft.operator.operator_metrics."""

from __future__ import annotations

from llamaft.operator.operator_metrics import RETRIES

__all__ = ["RETRIES"]
