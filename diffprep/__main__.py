"""``python -m diffprep`` (and ``torchrun -m diffprep``): the ``diffprep`` command."""

import sys

from diffprep.cli import main

sys.exit(main())
