"""`python -m llamaft_trainer`: the entry point torchrun starts on every node.

It leaves through exit_process, never through interpreter finalization (shutdown.py says why)."""

from llamaft_trainer.main import main
from llamaft_trainer.shutdown import exit_process

exit_process(main())
