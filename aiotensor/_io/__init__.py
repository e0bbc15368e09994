"""The I/O steps every feature shares, run through a Scheduler: tensors (bytes, checks, targets), staging, writing, reading."""
