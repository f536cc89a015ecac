"""Exceptions of the conformance suite (no torch)."""

from __future__ import annotations

__all__ = ["ClaimRefuted", "HarnessLimitation"]


class ClaimRefuted(AssertionError):
    """A declared claim does not hold; the message says what failed, where, and why it matters.

    An ``AssertionError`` so that pytest reports it as a test failure, with the
    message shown as is (the plugin copies it into the claims table).
    """


class HarnessLimitation(Exception):
    """The harness cannot check this claim for this backend (reported as a skip, with why)."""
