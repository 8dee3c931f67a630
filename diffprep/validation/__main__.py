"""``python -m diffprep.validation OUT``: strict validation of a finalized dataset (``diffprep.validation``)."""

import sys

from diffprep.validation import main

sys.exit(main())
