"""The rank processes of these tests import verl; its own package is left out of the fork
server's imports (importing it loads the plug-in, which reads SHARDSTREAM_VERL then), but
the libraries it imports are loaded there once: ~3 s less per verl rank. Not ``datasets``:
importing it starts pyarrow's jemalloc background thread, and ranks forked from a server
running a thread have crashed at random (test_rank_runner.py keeps the server single-threaded).
"""

from shardstream.testing import distributed

distributed.preload("tensordict", "peft", "ray")
