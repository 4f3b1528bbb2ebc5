"""Adapters that put shardstream behind other frameworks' checkpoint APIs (verl)."""
