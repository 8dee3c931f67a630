"""Model families: one module per family (its encoders, what it stores, its tiny test set)."""
