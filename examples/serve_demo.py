"""`make demo`: start `keel serve`, stream one chat answer with the official openai client, stop.

    python examples/serve_demo.py [MODEL] [--question TEXT]

The server runs as a child process on a free loopback port; the script waits for /health,
streams the answer to stdout as it arrives, then sends SIGTERM and checks the server exited 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, server: subprocess.Popen, log: IO[bytes], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
            sys.exit(f"demo: keel serve exited with code {server.returncode} before it was ready:\n" + "\n".join(tail))
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    sys.exit(f"demo: keel serve not healthy after {timeout:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "keel.cli", "serve", args.model, "--port", str(port)]
    print(f"$ keel serve {args.model} --port {port}", file=sys.stderr)
    log = tempfile.TemporaryFile()  # the server's log, shown only if it fails to start
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url, server, log, timeout=180)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
        print(f"> {args.question}", file=sys.stderr)
        stream = client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": args.question}],
            max_completion_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        print()
        if usage is not None:
            print(f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]", file=sys.stderr)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    if code != 0:
        print(f"demo: keel serve exited with code {code}", file=sys.stderr)
        return 1
    print("[server stopped cleanly]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
