"""A host tier that outlives the engine: `--swap-space-path DIR`.

The tier's bytes live in one memory-mapped file per worker (`data_file.py`), its index
in a file the scheduler half keeps (`block_index.py`), both in DIR (`directory.py`). A
new engine whose configuration has the same fingerprint (`fingerprint.py`) serves the
blocks they hold.
"""
