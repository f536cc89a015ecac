"""Capability declarations of the built-in backends: pure functions of
(platform, installed library versions), no kernel import."""
