"""Small shared inputs and helpers for the service tests."""

EOS_PROMPT = [4, 8, 15, 16, 23, 42, 4, 8]


def tp(trees) -> tuple:
    """A TreeBatch's (tokens, parents)."""
    return trees.tokens, trees.parents
