"""Training of the tiny Qwen3 family (tiny-code, tiny-code-draft, tiny-code-eagle3);
the command is bench/train_tiny.py."""
