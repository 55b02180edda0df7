"""The data plane's network: frame format, messages, codec, handshake, TLS transport, listener and next hop."""
