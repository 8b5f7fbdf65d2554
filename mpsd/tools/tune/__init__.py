"""`mpsd tune MODEL`: search a running model's serving settings (instances, batch size, queue delay,
preferred batch sizes, CUDA graphs) for the best throughput under a p99 bound, measured on the daemon's own
device. The search is search.py; one trial is measure.py; run() puts them together."""
