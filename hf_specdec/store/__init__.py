"""Cache folders on disk: where they live (`paths`), how their contents are written and checked
(`manifest`), and what identifies the model a cache was built from (`fingerprint`)."""
