"""What a client asks for and how tokens are chosen: requests, the Generator seam, sampling, tokenizer."""
