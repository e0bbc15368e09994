"""The runtime: worker threads, the GIL and collector windows, the scheduler, host buffers, CUDA streams."""
