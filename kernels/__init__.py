"""Kernels of treespec: paged tree attention, KV write, accept walk, KV compaction.

``treespec.kernels.reference`` is the pure-torch oracle and the CPU path; ``treespec.kernels.dispatch``
chooses the backend once per engine.
"""
