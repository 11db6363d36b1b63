"""`python -m itmatch VERB ...`, which torchrun needs: `torchrun --nproc_per_node N -m itmatch train ...`."""

import sys

from itmatch.cli import main

sys.exit(main())
