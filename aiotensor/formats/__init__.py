"""On-disk formats: pure functions from bytes to validated layouts and back; no I/O here."""
