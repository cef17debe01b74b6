#!/usr/bin/env python
"""radixserve and every installed peer engine on the same prompts, model and dtype, one after
another: the same as ``radixserve bench compare`` (see ``--help``). Install the peers first with
``make bench-peers``; a missing peer is reported in the table, not dropped."""

import sys

from radixserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "compare", *sys.argv[1:]]))
