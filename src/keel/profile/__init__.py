"""Profiling: where a decode step's time goes (`keel profile decode`)."""
