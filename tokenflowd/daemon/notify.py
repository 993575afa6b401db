"""systemd's service notification protocol (sd_notify(3)) for a Type=notify unit.

systemd sets NOTIFY_SOCKET (a path, or an abstract name starting with "@") and, with
WatchdogSec=, WATCHDOG_USEC. The daemon sends newline-separated KEY=VALUE datagrams:
READY=1 once an engine serves, STATUS=... as its state changes, WATCHDOG=1 from the event loop
every half watchdog period (so a stalled loop stops the pings and systemd restarts the service),
STOPPING=1 when it starts to drain. Without NOTIFY_SOCKET every call does nothing.

NOTE: hand-written: the protocol is one datagram per message, and the Python packages for it are
either unmaintained (sdnotify, last released 2017) or bind libsystemd through a C build.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger("tokenflowd.daemon.notify")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET") or None
        self.address = "\0" + addr[1:] if addr and addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        # WATCHDOG_PID names the process systemd expects the pings from; another one's is not ours.
        mine = pid is None or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 2e6 if usec and usec.isdigit() and int(usec) > 0 and mine else None
        self._sock: socket.socket | None = None
        self._failing = False  # the last send failed: say so once, not at every ping
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> None:
        """One datagram: send(READY=1, STATUS="serving"). A lost message is logged, never raised:
        the service must run on whether systemd heard it or not."""
        if self._sock is None:
            return
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(msg, self.address)
        except OSError as e:
            if not self._failing:
                log.warning("sd_notify %s failed: %s (further failures not logged until one succeeds)", msg[:40], e)
            self._failing = True
        else:
            self._failing = False

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self, status: str) -> None:
        self.send(STOPPING=1, STATUS=status)

    async def watchdog(self) -> None:
        """Ping every half period while the loop runs (a task: cancel it to stop)."""
        if self.watchdog_interval is None:
            return
        while True:
            self.send(WATCHDOG=1)
            await asyncio.sleep(self.watchdog_interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
