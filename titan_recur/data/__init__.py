"""Tokens in: the tokenizer and the packed, resumable data loader."""
