"""keel: a PyTorch-native LLM systems stack (train, adapt, serve) on one model definition."""

from keel.platform import export_isa_caps
from keel.version import __version__

__all__ = ["__version__"]
# KEEL_CPU_ISA caps torch's own kernels too, if set before torch runs an operator (keel.platform).
export_isa_caps()


def __getattr__(name: str):
    # `keel.LLM` / `keel.SamplingParams` without importing torch-heavy modules on `import keel`.
    if name in ("LLM", "SamplingParams", "EngineConfig", "AsyncEngine"):
        import keel.serve

        return getattr(keel.serve, name)
    raise AttributeError(f"module 'keel' has no attribute {name!r}")
