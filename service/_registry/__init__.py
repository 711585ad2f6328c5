"""The registry: names, versions, leases, sessions, memory, quotas, waits, the broker."""
