"""`keel serve` as a child process on a free loopback port: what the demo, the serving benchmark
and the HTTP tests all need (start, wait for /health, read the log, SIGTERM and collect the exit code)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from keel.errors import KeelError
from keel.net import free_port


class ServerProcess:
    """`keel serve MODEL --port P [ARGS...]`, its stdout and stderr in `log_path` (a temp file if None)."""

    def __init__(self, model: str | Path, *args: str, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "keel.cli", "serve", str(model), "--port", str(self.port), *args]
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="keel-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open as long as the process runs
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0, poll: float = 0.2) -> ServerProcess:
        """Return once /health answers 200; KeelError (with the log's tail) if it exits or times out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise KeelError(f"keel serve exited with code {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(poll)
        raise KeelError(f"keel serve not ready after {timeout:g} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) + f" (log: {self.log_path})"

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (a graceful drain: exit 0 expected); SIGKILL if it has not exited after `timeout` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
