"""Shared pieces of treespec: config, trees, acceptance, Qwen3, paged KV, codec."""
