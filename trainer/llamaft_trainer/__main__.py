"""`python -m llamaft_trainer`: the entry point torchrun starts on every node.

A torchrun restart after a configuration error exits 2 at once, before torch is imported
(process/restarts.py says why). torchao is kept out of a run without float8 (quiet.py says why). It leaves
through exit_process, never through interpreter finalization (shutdown.py says why)."""

from llamaft_trainer.process.restarts import replay_permanent_error

code = replay_permanent_error()
if code is None:
    import os
    import sys

    from llamaft_trainer.process.quiet import config_argument, prepare_trainer

    # Before torch and transformers load: torchao only for a float8 run, torch's known notice off (quiet.py).
    prepare_trainer(config_argument(sys.argv[1:], os.environ.get("LLAMAFT_CONFIG", "/etc/llamaft/config.json")))
    from llamaft_trainer.main import main

    code = main()

from llamaft_trainer.process.shutdown import exit_process  # noqa: E402

exit_process(code)
