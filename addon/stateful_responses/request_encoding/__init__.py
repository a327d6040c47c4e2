"""Compressed request bodies: decoded for every capability, sent on as the client encoded them."""
