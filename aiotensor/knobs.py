"""Every tunable of aiotensor, in one place: what each trades, and the benchmark (``bench/``, results
in ``bench/results/``) that chose its value. The caps a hostile file meets are limits, not
tunables: they live with their formats (``aiotensor/formats``)."""

from __future__ import annotations

MiB = 1 << 20

# --- worker threads (aiotensor._runtime.threads) ------------------------------------------------
# How many nice levels below the process the workers run: the loop's thread gets a core the moment
# it is ready, the copies take what is left (bench_stall_cause.py: run-queue stalls).
NICE = 10
# An idle worker thread ends after this long, so nothing is left behind by a forgotten scheduler.
IDLE_S = 10.0

# --- the scheduler (aiotensor._runtime.scheduler) ----------------------------------------------
# Worker threads and calls in flight per scheduler: enough to keep the disk's queue full on 2 cores
# (bench_cpu.py, bench_read_patterns.py).
WORKERS = 4
# The largest piece one engine call writes, or reads into device memory; also a bounce slot's size
# (bench_cpu.py).
CHUNK_BYTES = 16 * MiB
# The most bytes one worker-thread call moves before the loop gets a say: priorities act between
# batches (bench_loop.py).
BATCH_BYTES = 64 * MiB
# The largest read into host memory: a kernel copying from the page cache holds its core that long
# on kernels without preemption, the loop's thread waiting (bench_stall_cause.py).
HOST_READ_BYTES = 1 * MiB
# With a descriptor that bypasses the page cache (O_DIRECT), what the cache does not hold is read
# in pieces of this (cold 1 GB: 1.5-1.9 GB/s against 0.5-0.7 GB/s buffered in 1 MiB pieces on the
# development VM; no kernel copy holds a core, so the piece can be big: bench_serving.py). What the
# cache holds is still copied in pieces of HOST_READ_BYTES.
DIRECT_READ_BYTES = 8 * MiB
# Reads smaller than this stay buffered: the kernel's read-ahead serves neighbouring small reads.
DIRECT_MIN_BYTES = 256 * 1024
# A map over more units than this is cut into batches and joined in a worker, not on the loop
# (bench_loop.py).
INLINE_UNITS = 256

# --- the GIL and the collector (aiotensor._runtime.gil) -----------------------------------------
# While a save or load runs, the GIL switch interval is at most this (Python's is 5 ms): the loop's
# thread waits that long at most for a worker in Python code. 1 ms until 2026-11-26; at 0.5 ms the
# loop's p99 lag with 20,000 tensors fell from 4.1 to 2.5 ms (a store's load), 2.6 to 1.6
# (load_into), 3.6 to 3.1 (stream), no slower; 0.2 ms gained little more
# (bench/results/loop-switch-2026-11-26.log: bench_loop.py, 3 runs of 3 each).
SWITCH_INTERVAL_S = 0.0005
# During a long collector pause, a worker collects the young generations this often (bench_loop.py).
YOUNG_EVERY_S = 5.0
# Objects made during a pause are moved to the oldest generation unwalked when more than this many
# are young as it ends (a load of 20,000 tensors: bench_loop.py).
PROMOTE_OVER = 10_000
# JSON values one call of the C encoder takes (it holds the GIL throughout): about 1 ms (bench_loop.py).
JSON_CHUNK_VALUES = 2048

# --- host memory (aiotensor._runtime.buffers, aiotensor._io.write) ------------------------------
# A new staging arena is touched in pieces of this, the GIL released between them (bench_cpu.py:
# a fresh store's first save).
TOUCH_BYTES = 16 * MiB
# A staging arena of at least this many bytes is mapped only where the host's memory (a container's
# limit) has room for it (buffers.memory_room: a few reads of /proc and /sys, ~0.1 ms).
ROOM_CHECK_BYTES = 64 * MiB
# A single file of at least this many bytes (of few, large tensors) is assembled in page-aligned
# bounce slots and written with O_DIRECT (bench_cpu.py: durable save_file).
IMAGE_MIN_BYTES = 4 * MiB

# New CPU tensors read from one file (load_file, stream, a store's load()) are carved from
# page-aligned allocations, read in few big calls: tensors of at most CARVE_TENSOR_BYTES that are
# neighbours in the file share one of at most CARVE_BLOCK_BYTES (each tensor a storage of its own
# over its bytes there: _io.tensors.views); a bigger tensor has
# one of its own (bench_serving.py: 20,000 tensors).
CARVE_TENSOR_BYTES = 1 * MiB
CARVE_BLOCK_BYTES = 16 * MiB
# where each read is a request (an object store): small tensors at most this far apart in the file
# are fetched by one read (a torch.save zip's storages have their entries' headers between them)
CARVE_GAP_BYTES = 64 * 1024
# Tensors of at most this many bytes that exist already (load_into, a swap, load(into=)) are read
# with their neighbours in the file: straight into each by one preadv where the page cache holds
# them, else into a bounce slot and copied out: a syscall per 5 KB tensor cost more than the copy
# (bench_serving.py: 20,000 tensors). Where each read is a request (an
# object store), tensors up to CARVE_TENSOR_BYTES are.
GATHER_TENSOR_BYTES = 64 * 1024
# a memmove of at most this many bytes keeps the GIL (_runtime.buffers.move)
MOVE_HELD_BYTES = 64 * 1024

# --- saves (aiotensor.store) --------------------------------------------------------------------
# The largest shard file of a checkpoint (a tensor is never split).
SHARD_BYTES = 4 << 30
# The largest shard of tensors that may be unchanged since the last save (incremental saves: such a
# shard is reused whole, or written whole; smaller ones are reused more often).
CANDIDATE_SHARD_BYTES = 256 * MiB
# Shard headers kept for the next save of a state in the same layout, at most this many tensors'
# entries (~200 bytes each): every save of a training run plans the same shards.
PLANNED_TENSORS = 1 << 16
# The largest shard on an object store: each is one PUT (nothing to orphan if interrupted), and
# several shards upload at once.
OBJECT_SHARD_BYTES = 256 * MiB
# Staging arenas, so saves staged or writing at once: one stages while the last writes (bench_cpu.py).
MAX_STAGED = 2
# Seconds between two tries of a lock another writer holds.
LOCK_POLL_S = 0.05
# Seconds an object store's writer lease lasts: renewed every third of it, taken over by another
# writer once not renewed for all of it (so a crashed writer's store is free after this long).
LEASE_S = 30.0
# Seconds between two tries of a lease another writer holds (each costs two requests).
LEASE_POLL_S = 1.0
# Requests to an object store: 5xx answers (503 SlowDown), dropped connections and timeouts are
# retried with exponential backoff (0.1 s doubling, at most 5 s apart) up to OBJECT_RETRIES times
# within OBJECT_RETRY_S seconds, then the operation fails; one request may take OBJECT_TIMEOUT_S
# (a 256 MiB shard at 1 MB/s would not make it: raise it for slow links).
OBJECT_RETRIES = 5
OBJECT_RETRY_S = 60.0
OBJECT_TIMEOUT_S = 300.0
OBJECT_CONNECT_S = 5.0
# a store's mirror that could not be reached is tried again at most this often (the uploads queued
# meanwhile fail at once, each its handle.mirrored's OSError): not a 60 s retry per queued upload
MIRROR_RETRY_S = 30.0

# A load into given tensors keeps a local step's shards open from their check to their read where
# the step has at most this many (a step retired meanwhile is then read whole from its unlinked
# files; beyond, each is opened for its read again, and a retirement can leave `into` half written).
# Each concurrent load holds that many descriptors at most: 4 of them, 256 of a 1,024 limit
HELD_SHARDS = 64

# --- streams and module loads (aiotensor.serving) -----------------------------------------------
# Bytes of tensors a stream reads ahead of its consumer.
WINDOW_BYTES = 256 * MiB
# Neighbouring tensors of one file are read together, up to this many bytes and tensors (a bigger
# tensor alone), each batch in one worker call; a load into a module copies them in worker calls of
# the same size. Each batch costs about 1 ms of CPU beyond its bytes: a stream of a 0.5 GB file
# took 131 ms in 16 MiB batches, 109 ms in 64 MiB ones, as load_file (bench_serving.py); the count
# bounds the batches of many small tensors (bench_loop.py: 20,000 tensors).
STREAM_BATCH_BYTES = 64 * MiB
STREAM_BATCH_TENSORS = 512
# A stream of a local file reads batches while at most this many batches' worth of tensors
# (STREAM_BATCH_TENSORS each) are in flight, one batch at least (and a batch per worker at most):
# batches of many small tensors are Python work, and more of them at once shared the GIL with the
# loop's thread, which then waited for it more than 2 ms 2-3 times as often (20,000 tensors of 256
# bytes: 8% of 1 ms ticks against 3%, in the same time; a 0.5 GB file of 10,000 tensors of 50 KB
# read as fast). An object store's batches are not held back (their reads wait on latency).
STREAM_BATCHES_IN_FLIGHT = 2
# A consumer whose next tensors are already read lets other tasks run at least this often.
YIELD_S = 0.0005
