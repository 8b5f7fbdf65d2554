"""Which models are in memory: load on demand, unload when idle, evict the least recently used."""
