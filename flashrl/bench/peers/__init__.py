"""``flashrl bench peers`` / ``flashrl bench seeds``: flashrl (async and sync) against Hugging Face TRL's
GRPOTrainer, same everything; or flashrl alone over seeds.

The two sides live apart:

    runner.py    flashrl's side and the driver: each (seed, mode) run as a child process (``flashrl run``
                 or the TRL program), watched from here; ``run_bench`` runs them one at a time
    report.py    a run's numbers from its metrics.jsonl (same keys on both sides), the tables and the
                 results files (results.json, .csv, .md, .png)
    trl_grpo.py  the PEER: the config's training run as a TRL GRPOTrainer program, started by runner.py
                 as ``python -m flashrl.bench.peers.trl_grpo``; the only module that imports TRL

The command lines (options, defaults) are in flashrl/bench/cli.py.
"""
