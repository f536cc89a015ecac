"""Engine bridges: optional extras that connect attnreg to a serving engine.

Nothing in attnreg's core imports this package; each bridge imports its
engine (and anything in attnreg) and is switched on by the engine's own
plugin mechanism.  See docs/integrations/.
"""
