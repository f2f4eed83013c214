"""``flashrl bench``: every benchmark of flashrl, one package (the command lines: cli.py).

    cli.py        the typer sub-application ``flashrl bench`` (one command per mode and per shipped scenario)
    sweep.py      the scenario sweeps: a scenario file, or every shipped one of a mode (``flashrl bench all``)
    scenario.py   scenario files (shipped ones under scenarios/, package data), their checks, each run's config
    simulate.py   simulator mode: the ROLL Flash ablations, each point async against the sync baseline,
                  through the REAL controller on virtual time (bounds, token ledger, plots)
    real.py       real mode (``mode = "real"`` scenarios, or ``--mode real``): real vLLM engines and the
                  real trainer on this machine, wall-clock time
    overhead.py   ``kind = "overhead"`` scenarios: the controller's CPU per sample against engines that
                  answer at once, and the ZeroMQ path in requests per second; ``flashrl bench controller-profile``
    calibrate.py  ``flashrl bench calibrate``: fit the simulator to a real run (and cross-check real results)
    algorithms.py ``flashrl bench algorithms``: losses x async ratio (learning, not speed)
    chaos.py      ``flashrl bench chaos``: a training run under repeated SIGKILLs; chaos_report.py: the proof
                  it lost nothing (pure functions of the run's records)
    steptime.py   ``flashrl bench steptime``: where a training step's time goes, phase by phase
    peers/        ``flashrl bench peers`` / ``seeds``: flashrl against Hugging Face TRL's GRPOTrainer; the TRL
                  program (peers/trl_grpo.py) is kept apart from flashrl's side (peers/runner.py, report.py)

Nothing here is imported by a training run: the package sits above the launch layer (tests/unit/test_imports.py).
The measurement scripts in the repository's bench/ folder (engine internals, transports, resume, Ray)
are one-off experiments behind committed results, not part of the command.
"""
