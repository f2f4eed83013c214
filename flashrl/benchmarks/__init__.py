"""The bench code of `flashrl bench` (the command: flashrl/bench.py); shipped scenario files under scenarios/ (package data)."""
