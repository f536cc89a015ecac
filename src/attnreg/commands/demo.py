"""``attnreg demo``: the compatibility report `make demo` prints.

For this machine (detected) and the simulated H200 (``cuda:sm90``) and B200
(``cuda:sm100``), named as GPUs so that the plan's default capture budget
uses their memory: the backends table, then the graph plan for a
DeepSeek-V3 preset with its decision trace.
"""

from __future__ import annotations

import argparse

from attnreg.cli import main as cli_main

DEFAULT_PLATFORMS = ("detect", "h200", "b200")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="deepseek-v3", help="model preset for the plan")
    parser.add_argument("--platform", action="append", default=None,
                        help="platforms to report (repeatable; default: this machine, "
                             "h200 (cuda:sm90), b200 (cuda:sm100))")


def run(args: argparse.Namespace) -> int:
    status = 0
    for platform in args.platform or DEFAULT_PLATFORMS:
        title = "this machine" if platform == "detect" else f"simulated {platform}"
        print("=" * 78)
        print(f"== {title}")
        print("=" * 78)
        plat_args = [] if platform == "detect" else ["--platform", platform]
        status |= cli_main(["backends", *plat_args])
        print()
        status |= cli_main(["compat", "--model", args.model, *plat_args])
        print()
    return status
