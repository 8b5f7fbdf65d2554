"""The daemon's handle on one worker process."""
