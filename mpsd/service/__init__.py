"""Install and control mpsd as an operating-system service (launchd on macOS, systemd on Linux).

The daemon itself knows nothing about service managers beyond `mpsd.daemon.sdnotify`; everything that
writes plists or units and drives `launchctl`/`systemctl` lives here, behind `mpsd service ...`.
"""
