"""Sources (what shardstream reads) and sinks (what it writes), one module per format."""
