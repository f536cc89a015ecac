"""The conformance suite, shipped in the wheel (see attnreg.testing.plugin)."""
