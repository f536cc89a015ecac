import sys

sys.exit("attnreg_exit_import refuses to load")  # the point of this plugin
