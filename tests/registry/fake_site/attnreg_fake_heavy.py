"""Stands in for a heavy library (torch) in the startup-guard tests."""
