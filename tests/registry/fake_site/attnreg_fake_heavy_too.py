"""Stands in for a heavy library imported by a hook."""
