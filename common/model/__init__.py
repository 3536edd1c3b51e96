"""Qwen3: its architecture numbers, HF checkpoint loading, the forward, the tokenizer."""
