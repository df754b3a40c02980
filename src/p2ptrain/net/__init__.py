"""Network layer: HTTP/WebSocket server, gossip, discovery, blob transfer, relay."""
