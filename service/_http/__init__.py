"""The HTTP doors: the fast lane, the ASGI door, the gate, handlers, routes, the server."""
