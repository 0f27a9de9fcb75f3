"""Start `keel serve` in a subprocess on a free port for the HTTP tests, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path | str, *args: str, name: str = "tiny", log_path: Path | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.name = name
        cmd = [sys.executable, "-m", "keel.cli", "serve", str(model), "--port", str(self.port),
               "--served-model-name", name, "--threads", "1", *args]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, env=env)

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"keel serve exited with {self.proc.returncode}: {self.logs()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"keel serve not ready after {timeout} s: {self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode
