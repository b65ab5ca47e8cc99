"""A real DNS server for the tests: Debian's dnsmasq, unprivileged on a free port of 127.0.0.1,
answering only from a hosts file the test rewrites (SIGHUP re-reads it)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from extproc.stack.ports import free_port

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
DOMAIN = "svc.test"


def _udp_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Dnsmasq:
    """dnsmasq answering `*.svc.test` from `hosts` (NXDOMAIN for a name it does not list).

    Args:
        workdir: where the hosts file, pid file and log go.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.hosts = workdir / "hosts"
        self.hosts.write_text("", encoding="utf-8")
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def write(self, records: dict[str, list[str]]) -> None:
        """Replace the records (name → addresses) and make dnsmasq re-read them."""
        lines = [f"{ip} {name}" for name, ips in records.items() for ip in ips]
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(self.hosts)
        if self._proc is not None:
            self._proc.send_signal(signal.SIGHUP)

    def start(self, port: int | None = None) -> None:
        """Start on `port` (default: a free one); returns once it answers."""
        for _ in range(20):
            self.port = port or free_port()
            if _udp_free(self.port):
                break
        log = open(self.workdir / "dnsmasq.log", "ab")  # noqa: SIM115 - the child keeps it
        self._proc = subprocess.Popen(
            [
                DNSMASQ, "--no-daemon", "--conf-file=/dev/null", f"--port={self.port}", "--listen-address=127.0.0.1",
                "--bind-interfaces", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", f"--local=/{DOMAIN}/",
                f"--pid-file={self.workdir / 'dnsmasq.pid'}", "--log-facility=-",
            ],
            stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited with {self._proc.returncode}: {(self.workdir / 'dnsmasq.log').read_text()}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("dnsmasq did not start listening")

    def stop(self) -> None:
        """Stop it (by PID) and wait."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
