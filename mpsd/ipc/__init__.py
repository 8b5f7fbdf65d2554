"""The IPC protocol between the daemon and its workers: the only code both sides share."""
