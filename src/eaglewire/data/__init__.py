"""Conversations, regeneration and hidden-state shards."""
