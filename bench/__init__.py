"""Overhead benchmarks for mpsd: `make bench` (or `python -m bench.run`) runs them; see bench/README.md."""
