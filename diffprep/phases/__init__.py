"""The phases that consult the encoding (fetch, verify, audit, preflight) and the pipeline that runs them."""
