"""Configuration: the model repository format and the daemon's own settings."""
