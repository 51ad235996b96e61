"""The cross-region relay (design 4.3): relay tokens, the edge's QUIC client, and the far end."""
