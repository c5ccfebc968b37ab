"""Cache folders on disk: where they live (`paths`) and how their contents are checked (`manifest`)."""
