"""`python -m llamaft_trainer`: the entry point torchrun starts on every node."""

import sys

from llamaft_trainer.main import main

sys.exit(main())
