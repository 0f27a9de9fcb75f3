"""keel's version, importable without anything else of keel."""

__version__ = "0.1.0"
