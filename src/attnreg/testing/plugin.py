"""pytest plugin of the conformance suite (registered through the pytest11 entry point).

Importing it must stay cheap: no torch at import time.
"""
