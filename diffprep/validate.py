"""``python -m diffprep.validate OUT``: strict validation of a finalized dataset (``diffprep.validation``)."""

from __future__ import annotations

import sys

from diffprep.validation import Check, ValidationReport, main, validate_dataset

__all__ = ["Check", "ValidationReport", "main", "validate_dataset"]

if __name__ == "__main__":
    sys.exit(main())
