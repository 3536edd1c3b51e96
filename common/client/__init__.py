"""The Python client SDK for the Generation service (sdk.py), its CLI and the demo.

    from treespec.common.client import TreespecClient
"""

from treespec.common.client.sdk import (AsyncTreespecClient, Chunk, Collector, Completion,
                                        ServerInfo, TreespecClient, TreespecError,
                                        build_request, tokens_per_step)

__all__ = ["AsyncTreespecClient", "Chunk", "Collector", "Completion", "ServerInfo",
           "TreespecClient", "TreespecError", "build_request", "tokens_per_step"]
