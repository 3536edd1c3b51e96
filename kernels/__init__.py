"""Kernels of treespec: paged tree attention, KV write, accept walk, KV compaction.

``kernels.reference`` is the pure-torch oracle and the CPU path; ``kernels.dispatch``
chooses the backend once per engine.
"""
