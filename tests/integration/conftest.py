"""The rank processes of these tests import verl; its own package is left out of the fork
server's imports (importing it loads the plug-in, which reads SHARDSTREAM_VERL then), but
the libraries it imports are loaded there once: ~3 s less per verl rank."""

from shardstream.testing import distributed

distributed.preload("tensordict", "peft", "ray", "datasets")
