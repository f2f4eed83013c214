"""Benchmarks beside the speed-up sweeps of flashrl.bench: controller overhead, calibration."""
