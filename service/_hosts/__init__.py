"""Across hosts: Arrow Flight, peers, what a peer's token may touch, traffic."""
