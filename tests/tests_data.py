"""Small shared inputs for the service tests."""

EOS_PROMPT = [4, 8, 15, 16, 23, 42, 4, 8]
