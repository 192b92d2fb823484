"""Paged attention under Hugging Face modeling code, and the paged KV cache it reads and writes."""
