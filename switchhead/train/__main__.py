"""``python -m switchhead.train ARGS`` = ``switchhead train ARGS``; the entry point for torchrun:

torchrun --nproc_per_node 8 -m switchhead.train --config switchhead-47m --data ... --out run/
"""

import sys

from switchhead.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]], prog_name="switchhead")
