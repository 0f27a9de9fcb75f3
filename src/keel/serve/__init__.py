"""The serving engine: scheduler, paged KV cache, runner, sampling, stop conditions, API."""
