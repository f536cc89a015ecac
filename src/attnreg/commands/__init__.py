"""Subcommands of the ``attnreg`` CLI, one module each (see ``attnreg.cli``)."""
