"""keel: a PyTorch-native LLM systems stack (train, adapt, serve) on one model definition."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `keel.LLM` / `keel.SamplingParams` without importing torch-heavy modules on `import keel`.
    if name in ("LLM", "SamplingParams", "EngineConfig", "AsyncEngine"):
        import keel.serve

        return getattr(keel.serve, name)
    raise AttributeError(f"module 'keel' has no attribute {name!r}")
