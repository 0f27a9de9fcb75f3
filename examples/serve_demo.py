"""`make demo`: start `keel serve`, stream one chat answer with the official openai client, stop.

    python examples/serve_demo.py [MODEL] [--question TEXT]

The server runs as a child process on a free loopback port; the script waits for /health,
streams the answer to stdout as it arrives, then sends SIGTERM and checks the server exited 0.
"""

from __future__ import annotations

import argparse
import sys

import openai

from keel.errors import KeelError
from keel.serve.openai.child import ServerProcess


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    server = ServerProcess(args.model)
    print(f"$ keel serve {args.model} --port {server.port}", file=sys.stderr)
    try:
        try:
            server.wait_ready(timeout=180)
        except KeelError as e:
            print(f"demo: {e}", file=sys.stderr)
            return 1
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
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
        code = server.terminate(timeout=60)
    if code != 0:
        print(f"demo: keel serve exited with code {code}", file=sys.stderr)
        return 1
    print("[server stopped cleanly]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
