"""The coordinator: per-stream scheduling, speculative decoding, and the ring of stage workers it drives."""
